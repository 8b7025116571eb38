"""Fixtures for the trainer tests: the trainer service as a real process (over Slurm or the local
launcher) running the stand-in training program, and a client for its API and events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import nats.errors
import pytest

from loopline.common import bus, launcher, subjects
from support.trainer import TrainerClient

STANDIN = Path(__file__).with_name("standin.py")


@pytest.fixture(params=["slurm", "local"])
def launcher_kind(request) -> str:
    if request.param == "slurm":
        request.getfixturevalue("slurm")  # skips without Slurm
    return request.param


@pytest.fixture
async def nc(nats_url):
    conn = await bus.connect(nats_url, "trainer-test")
    await bus.ensure_topology(conn.jetstream())
    yield conn
    await conn.close()


@pytest.fixture
def jobs_dir(tmp_path) -> Path:
    return tmp_path / "jobs"


@pytest.fixture
def start_trainer(request, nats_url, tmp_path, jobs_dir):
    """``await start_trainer(kind, **settings)`` starts ``python -m loopline.trainer`` as the stack
    does, running the stand-in program; returns once it answers requests. Runs it left behind are
    stopped after the test."""
    procs: list[launcher.Proc] = []
    kinds: set[str] = set()

    async def start(kind: str, **extra: str) -> launcher.Proc:
        env = {
            "LOOPLINE_NATS_URL": nats_url,
            "LOOPLINE_STATE_DIR": str(tmp_path),
            "LOOPLINE_JOBS_DIR": str(jobs_dir),
            "LOOPLINE_LAUNCHER": kind,
            "LOOPLINE_TRAIN_COMMAND": f"{sys.executable} {STANDIN}",
            "LOOPLINE_RECONCILE_INTERVAL_S": "0.25",
            "LOOPLINE_MODEL": "tiny",
            **{f"LOOPLINE_{k.upper()}": str(v) for k, v in extra.items()},
        }
        if kind == "slurm":
            env.update(request.getfixturevalue("slurm").env)
        kinds.add(kind)
        proc = launcher.start_service("trainer", env, tmp_path / "logs" / f"trainer-{len(procs)}.log")
        procs.append(proc)
        await wait_ready(proc, nats_url)
        return proc

    yield start
    for proc in procs:
        launcher.stop(proc)
    if "slurm" in kinds:
        request.getfixturevalue("slurm").cancel_all()
    kill_local_runs(jobs_dir / ".local-runs")


def kill_local_runs(runs_dir: Path) -> None:
    """SIGKILL the local launcher's runs that are still alive (only the ones this test started)."""
    for record_path in runs_dir.glob("L*.json") if runs_dir.is_dir() else []:
        record = json.loads(record_path.read_text())
        try:
            stat = Path(f"/proc/{record['pid']}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[19] == record["start"]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record["pid"], signal.SIGKILL)


async def wait_ready(proc: launcher.Proc, nats_url: str, timeout_s: float = 30.0) -> None:
    nc = await bus.connect(nats_url, "trainer-test-ready")
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"trainer exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                await nc.request(subjects.SVC_TRAINER_STATUS, b"{}", timeout=0.5)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.05)
        raise TimeoutError(f"trainer not ready after {timeout_s}s:\n{proc.log_tail()}")
    finally:
        await nc.close()


@pytest.fixture
def client(nc) -> TrainerClient:
    return TrainerClient(nc)
