"""The gateway alone as its own process (no queue, no inference), for tests of its routes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loopline.common.local import launcher

BASE_MODEL = "test-org/base-model"
# Small limits, so the 413 tests need not send megabytes.
MAX_UPLOAD_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 64 * 1024
MAX_DATASET_BYTES = 1024 * 1024
MAX_MEMBERS = 100


@dataclass
class Gateway:
    url: str
    proc: launcher.Proc
    state_dir: Path


def start_gateway(nats_url: str, state: Path, port: int | None = None, **env: str) -> Gateway:
    """The gateway on ``port`` (a free one when None: a restart passes the old one, so clients keep
    their URL), its state under ``state``; ``env`` adds or overrides settings."""
    port = port or launcher.free_port()
    env = {
        "LOOPLINE_NATS_URL": nats_url,
        "LOOPLINE_STATE_DIR": str(state),
        "LOOPLINE_PORT": str(port),
        "LOOPLINE_MODEL": BASE_MODEL,
        "LOOPLINE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD_BYTES),
        "LOOPLINE_MAX_CHUNK_BYTES": str(MAX_CHUNK_BYTES),
        "LOOPLINE_MAX_DATASET_BYTES": str(MAX_DATASET_BYTES),
        "LOOPLINE_MAX_ARCHIVE_MEMBERS": str(MAX_MEMBERS),
        "LOOPLINE_TRAINER_TIMEOUT_S": "5",
        **env,
    }
    proc = launcher.start_service("gateway", env, state / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url)
    return Gateway(url, proc, state)


def wait_until_up(proc: launcher.Proc, url: str, timeout_s: float = 60.0) -> None:
    """Until the gateway at ``url`` answers its keep-alive probe; stopped, and its log raised, if
    it exits or does not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/v1/health/keepalive", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not proc.alive() or time.monotonic() > deadline:
            launcher.stop(proc)
            raise RuntimeError(f"the gateway did not start:\n{proc.log_tail()}")
        time.sleep(0.1)


def wait_job(http: httpx.Client, job: str, *statuses: str, timeout_s: float = 60.0) -> dict:
    """Poll ``GET /v1/megatron/train/{job}`` until the job's status is one of ``statuses``; its
    ``job_status``."""
    deadline = time.monotonic() + timeout_s
    # Invariant: every answer so far was a 200 with a status not yet wanted.
    while True:
        resp = http.get(f"/v1/megatron/train/{job}")
        assert resp.status_code == 200, resp.text
        status = resp.json()["job_status"]
        if status["status"] in statuses:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} still {status['status']} after {timeout_s} s (want {statuses})")
        time.sleep(0.1)
