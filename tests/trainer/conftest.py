"""Fixtures for the trainer tests: the trainer service as a real process (over Slurm or the local
launcher) running the stand-in training program, and a client for its API and events."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopline.common.local import launcher
from support.trainer import TrainerClient
from support.trainer_process import stop_local_runs, trainer_env, wait_ready


@pytest.fixture(params=["slurm", "local"])
def launcher_kind(request) -> str:
    if request.param == "slurm":
        request.getfixturevalue("slurm")  # skips without Slurm
    return request.param


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

    async def start(kind: str, **extra: object) -> launcher.Proc:
        env = trainer_env(nats_url, tmp_path, jobs_dir, kind, **extra)
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
    stop_local_runs(jobs_dir)


@pytest.fixture
def client(nc) -> TrainerClient:
    return TrainerClient(nc)
