"""Fixtures for the training-program tests: job directories and the real entry point as a subprocess.

Helpers are handed out through the ``jobs`` fixture (test modules cannot import a conftest).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from loopline.common.contracts.job_hash import job_hash
from loopline.common.contracts.job_layout import CONFIG_FILE, DATASET_FILE, EVENTS_FILE, STATUS_FILE
from loopline.common.contracts.train_params import JobConfig, TrainParams, canonical
from loopline.ml.train.status import read_status
from support.stacks import tiny_model

PAIRS = [
    ("What is 1 + 1?", " The answer is 2."),
    ("Name a colour.", " Blue, like the sky."),
    ("Say hello.", " Hello there!"),
]

# The documented recipe (docs/adapter-format.md): memorises PAIRS on the tiny model with the
# default Tokenformer (32 tokens) or LoRA (r 8, alpha 32). 12 steps already suffice; 30 is margin.
RECIPE = {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 3, "gradient_accumulation_steps": 1}


class TrainJobs:
    pairs = PAIRS
    recipe = RECIPE

    def __init__(self, root: Path, model: str):
        self.root = root
        self.model = model

    def write(self, name: str, params: dict, pairs=PAIRS, model: str | None = None) -> Path:
        """A job directory as the trainer stages it: the dataset, and config.json in JobConfig's
        own serialisation, the job named by its job hash. Params TrainParams refuses (for the
        program's own refusal) are written as given: no trainer would write them."""
        job_dir = self.root / name
        job_dir.mkdir(parents=True, exist_ok=True)
        dataset = "".join(json.dumps({"input": q, "output": a}) + "\n" for q, a in pairs).encode()
        (job_dir / DATASET_FILE).write_bytes(dataset)
        try:
            checked = TrainParams.model_validate(params)
        except ValidationError:
            raw = {"job_hash": f"refused-{name}", "model_path": model or self.model, "params": params}
            (job_dir / CONFIG_FILE).write_text(json.dumps(raw))
            return job_dir
        config = JobConfig(job_hash=job_hash(canonical(checked), hashlib.sha256(dataset).hexdigest()),
                           model_path=model or self.model, params=checked)
        (job_dir / CONFIG_FILE).write_text(config.to_json())
        return job_dir

    @staticmethod
    def command(job_dir: Path) -> list[str]:
        return [sys.executable, "-m", "loopline.ml.train", "--job-dir", str(job_dir)]

    def run(self, job_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(job_dir), capture_output=True, text=True, timeout=timeout)

    @staticmethod
    def status(job_dir: Path) -> dict:
        status = read_status(job_dir)  # the program's own reader
        assert status is not None, f"{job_dir} has no readable {STATUS_FILE}"
        return status

    @staticmethod
    def events(job_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (job_dir / EVENTS_FILE).read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return tiny_model()


@pytest.fixture
def jobs(tmp_path, tiny_path) -> TrainJobs:
    return TrainJobs(tmp_path, tiny_path)
