"""The CLI against the real stack its commands talk to: a nats-server, the trainer as its own process
running the stand-in training program (support/trainer_process.py, tests/trainer/standin.py) and the
gateway as its own process. One set per test module.

What a job does is chosen by its params, as for the gateway's tests: ``standin_step_s`` paces it,
``standin_fail`` fails it. What the CLI sent is read from what the trainer made of it: the job
directory, the ``datasets`` object store and the trainer's own svc.trainer.* answers."""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import pytest
from typer.testing import CliRunner

from loopline.cli.main import app as cli_app
from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import JobEvent, JobInfo, LogLines, LogsRequest
from loopline.common.local import launcher
from support.bus_view import BusView
from support.gateway_process import BASE_MODEL, start_gateway
from support.trainer import TrainerClient
from support.trainer_process import TrainerProcess

T = TypeVar("T")


class GatewayProcess:
    """The gateway as its own process; ``restart`` stops it and starts it again on the same port
    (as a redeploy does), so a client keeps its URL across it."""

    def __init__(self, nats_url: str, state) -> None:
        self.nats_url, self.state = nats_url, state
        self.current = start_gateway(nats_url, state)
        self.url = self.current.url
        self.restarts = 0

    def restart(self) -> float:
        """Stop, then start on the same port; the time the old process was gone."""
        launcher.stop(self.current.proc)
        stopped_at = time.time()
        self.current = start_gateway(self.nats_url, self.state, port=urlsplit(self.url).port)
        self.restarts += 1
        return stopped_at

    def stop(self) -> None:
        launcher.stop(self.current.proc)


class TrainerView(BusView):
    """The test's look at the trainer over NATS (support/bus_view.py), through support/trainer.py's
    TrainerClient, and at its job directories."""

    def __init__(self, nats_url: str, proc: TrainerProcess) -> None:
        super().__init__(nats_url, "cli-test")
        self.proc = proc

    def _ask(self, ask: Callable[[TrainerClient], Awaitable[T]]) -> T:
        return self.ask(lambda nc: ask(TrainerClient(nc)))

    def job_dir(self, job_hash: str) -> Path:
        return self.proc.job_dir(job_hash)

    def job(self, ref: str) -> JobInfo:
        return self._ask(lambda trainer: trainer.get(ref))

    def wait(self, ref: str, *statuses: str, min_step: int = 0, timeout_s: float = 60.0) -> JobInfo:
        """The job once its status is one of ``statuses`` and it has made ``min_step`` steps."""
        deadline = time.monotonic() + timeout_s
        # Invariant: every answer so far was a job not yet where it is wanted.
        while True:
            info = self.job(ref)
            if info.status.value in statuses and info.step >= min_step:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {ref} is {info.status.value} at step {info.step} after "
                                     f"{timeout_s} s (want {statuses}, step >= {min_step})")
            time.sleep(0.1)

    def events(self, job_hash: str) -> list[JobEvent]:
        """The job's events stored on the EVENTS stream now, in order."""
        return self._ask(lambda trainer: trainer.events(job_hash))

    def logs(self, ref: str) -> LogLines:
        return self.ask_trainer(subjects.SVC_TRAINER_LOGS, LogsRequest(job=ref), LogLines)


@pytest.fixture(scope="module")
def trainer(nats_proc, tmp_path_factory):
    proc = TrainerProcess(nats_proc.info["url"], tmp_path_factory.mktemp("trainer"), model=BASE_MODEL).start()
    yield TrainerView(nats_proc.info["url"], proc)
    proc.close()


@pytest.fixture(scope="module")
def gateway(nats_proc, trainer, tmp_path_factory):
    gw = GatewayProcess(nats_proc.info["url"], tmp_path_factory.mktemp("gateway"))
    yield gw
    gw.stop()


@pytest.fixture
def cli(request):
    """Run ``loopline`` in-process: ``cli("jobs")`` → click Result. Against the module's gateway,
    started on first use, unless ``url`` names another (then no stack is started at all)."""
    runner = CliRunner()

    def run(*args: str, url: str | None = None):
        return runner.invoke(cli_app, ["--url", url or request.getfixturevalue("gateway").url, *args])

    return run


@pytest.fixture
def refused_url() -> str:
    """A local URL where nothing listens: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
