"""A real nats-server, the real trainer (its own process, the local launcher, the stand-in training
program: support/trainer_process.py), the queue service where a module asks for it, and the gateway
as its own process; the gateway is what these tests exercise. One set per test module.

What the trainer received is read from what it made of it: the job directory (config.json, the
dataset, the job's ml/ code), the job's log and events, and the ``datasets`` object store."""

from __future__ import annotations

import time

import httpx
import nats.errors
import pytest

from loopline.common.contracts import subjects
from loopline.common.local import launcher
from support.bus_view import BusView
from support.gateway_process import BASE_MODEL, start_gateway
from support.trainer_process import TrainerProcess


@pytest.fixture(scope="module")
def trainer(nats_proc, tmp_path_factory):
    # Jobs may ship their own ml/ code (the scalarlm client sends ./ml when there is one); run as
    # root, not nobody: this environment's python may live where nobody cannot enter (/root/.pyenv).
    proc = TrainerProcess(nats_proc.info["url"], tmp_path_factory.mktemp("trainer"), model=BASE_MODEL,
                          allow_user_code=True, job_user="root").start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def queue_service(nats_proc, nats_bus, tmp_path_factory):
    """The real queue service (``python -m loopline.queue``), answering svc.queue.* (clear_queue)."""
    state = tmp_path_factory.mktemp("queue")
    env = {"LOOPLINE_NATS_URL": nats_proc.info["url"], "LOOPLINE_STATE_DIR": str(state),
           "LOOPLINE_STATE_INTERVAL_S": "0.1"}
    proc = launcher.start_service("queue", env, state / "queue.log")

    async def answers(nc) -> bool:
        try:
            await nc.request(subjects.SVC_QUEUE_STATUS, b"", timeout=0.5)
            return True
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return False

    deadline = time.monotonic() + 30
    # Invariant: the queue has not answered yet.
    while not nats_bus.ask(answers):
        assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.05)
    yield proc
    launcher.stop(proc)


@pytest.fixture(scope="module")
def gateway(nats_proc, trainer, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("gateway"))
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def nats_bus(nats_proc) -> BusView:
    return BusView(nats_proc.info["url"], "gateway-test")
