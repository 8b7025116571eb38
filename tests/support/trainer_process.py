"""The real trainer service as its own process for tests (``python -m loopline.trainer``, started as
the stack starts it), running the stand-in training program (tests/trainer/standin.py), with its own
SQLite registry and jobs directory under the test's state folder."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import nats.errors

from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import is_job_hash
from loopline.common.local import launcher
from loopline.common.runtime import bus
from loopline.trainer.launchers import Launcher, make_launchers

STANDIN = Path(__file__).resolve().parents[1] / "trainer" / "standin.py"


def trainer_env(nats_url: str, state_dir: Path, jobs_dir: Path, kind: str,
                **settings: object) -> dict[str, str]:
    """The trainer's settings: ``kind`` of launcher, the stand-in as the training command, a fast
    reconcile loop; ``settings`` are more TrainerSettings fields (``allow_user_code=True``)."""
    return {
        "LOOPLINE_NATS_URL": nats_url,
        "LOOPLINE_STATE_DIR": str(state_dir),
        "LOOPLINE_JOBS_DIR": str(jobs_dir),
        "LOOPLINE_LAUNCHER": kind,
        "LOOPLINE_TRAIN_COMMAND": f"{sys.executable} {STANDIN}",
        "LOOPLINE_RECONCILE_INTERVAL_S": "0.25",
        "LOOPLINE_MODEL": "tiny",
        **{f"LOOPLINE_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
           for k, v in settings.items()},
    }


async def wait_ready(proc: launcher.Proc, nats_url: str, timeout_s: float = 30.0) -> None:
    """Until the trainer answers svc.trainer.status (it has migrated its registry and connected)."""
    nc = await bus.connect(nats_url, "trainer-test-ready")
    try:
        deadline = time.monotonic() + timeout_s
        # Invariant: the trainer has not answered yet, and is still alive.
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


def local_launcher(jobs_dir: Path) -> Launcher:
    """The trainer's own local launcher over ``jobs_dir``: it reads the records the trainer's wrote."""
    return make_launchers("local", jobs_dir)[1]["local"]


def stop_local_runs(jobs_dir: Path, timeout_s: float = 10.0) -> None:
    """Stop the local runs still alive in ``jobs_dir`` (only this test's), as the trainer's cancel
    does: SIGTERM to the run's process group (the stand-in stops within a step), SIGKILL later."""
    local = local_launcher(jobs_dir)
    jobs = [p.name for p in jobs_dir.iterdir() if is_job_hash(p.name)] if jobs_dir.is_dir() else []
    deadline = time.monotonic() + timeout_s
    # Invariant: every run cancelled so far has been sent SIGTERM; `find` names a live one only.
    for job_hash in jobs:
        while (run_id := local.find(job_hash)) is not None and time.monotonic() < deadline:
            local.cancel(run_id)
            while not local.state(run_id).ended and time.monotonic() < deadline:
                time.sleep(0.05)


class TrainerProcess:
    """One trainer over the local launcher, for synchronous tests: ``start``, ``stop`` (its runs go
    on, as when the real one stops), ``start`` again on the same registry; ``close`` at the end."""

    def __init__(self, nats_url: str, state_dir: Path, **settings: object):
        self.nats_url = nats_url
        self.state_dir = state_dir
        self.jobs_dir = state_dir / "jobs"
        self.env = trainer_env(nats_url, state_dir, self.jobs_dir, "local", **settings)
        self.proc: launcher.Proc | None = None
        self.starts = 0

    def start(self) -> TrainerProcess:
        self.starts += 1
        self.proc = launcher.start_service("trainer", self.env, self.state_dir / f"trainer-{self.starts}.log")
        try:
            asyncio.run(wait_ready(self.proc, self.nats_url))
        except BaseException:
            launcher.stop(self.proc)
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            launcher.stop(self.proc)
            self.proc = None

    def close(self) -> None:
        self.stop()
        stop_local_runs(self.jobs_dir)

    def job_dir(self, job_hash: str) -> Path:
        return self.jobs_dir / job_hash
