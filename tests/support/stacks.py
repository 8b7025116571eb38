"""Starting Loopline stacks for end-to-end tests, with the models prepared once per run."""

from __future__ import annotations

from pathlib import Path

from loopline.common.local.stack import LocalStack

REPO = Path(__file__).resolve().parents[2]
# Prepared models live beside the checkout (git-ignored), so a CI machine converts SmolLM2 once.
MODELS_DIR = REPO / ".loopline" / "models"

# Short redelivery so a killed replica's work moves on within seconds, small body limit so the
# 413 test need not send megabytes. A session stack serves many test modules as one keyless
# holder, whose Tinker clients all stay live for the idle TTL: room for them all (the limits
# themselves are tests/gateway/test_tinker_request_limits.py's and tinker_worker/test_request_bounds.py's).
TEST_ENV = {
    "LOOPLINE_ACK_WAIT_S": "4",
    "LOOPLINE_MAX_BODY_BYTES": str(1024 * 1024),
    "LOOPLINE_MAX_TINKER_MODELS_PER_KEY": "512",
    "LOOPLINE_TINKER_MAX_CLIENTS": "512",
    "LOOPLINE_LOG_LEVEL": "INFO",
}


# The Slurm stack's idle TTL for Tinker session workers: short, so a test sees one released.
SLURM_TINKER_IDLE_TTL_S = 20


def tiny_model() -> str:
    from loopline.ml.models.resolve import resolve_model

    return str(resolve_model("tiny", MODELS_DIR))


def make_stack(state_dir: Path, model: str, *, replicas: int = 1, **env: str) -> LocalStack:
    return LocalStack(state_dir, model, replicas=replicas, env={**TEST_ENV, **env}, models_dir=MODELS_DIR)
