"""A real nats-server, the real trainer (its own process, the local launcher, the stand-in training
program: support/trainer_process.py) and the gateway as its own process; the gateway is what these
tests exercise. One set per test module.

What the trainer received is read from what it made of it: the job directory (config.json, the
dataset, the job's ml/ code), the job's log and events, and the ``datasets`` object store."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import pytest
from pydantic import BaseModel

from loopline.common import bus, launcher, subjects
from loopline.common.service_client import ServiceClient
from support.gateway_process import BASE_MODEL, start_gateway
from support.nats import nats_server
from support.trainer_process import TrainerProcess

T = TypeVar("T")
Reply = TypeVar("Reply", bound=BaseModel)


@pytest.fixture(scope="module")
def nats_proc(tmp_path_factory):
    with nats_server(tmp_path_factory.mktemp("nats")) as proc:
        yield proc


@pytest.fixture(scope="module")
def trainer(nats_proc, tmp_path_factory):
    # Jobs may ship their own ml/ code (the scalarlm client sends ./ml when there is one).
    proc = TrainerProcess(nats_proc.info["url"], tmp_path_factory.mktemp("trainer"), model=BASE_MODEL,
                          allow_user_code=True).start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def gateway(nats_proc, trainer, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("gateway"))
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


class Bus:
    """The test's own look at NATS, for synchronous tests: one short connection per question."""

    def __init__(self, url: str):
        self.url = url

    def _run(self, ask: Callable[..., Awaitable[T]]) -> T:
        async def go() -> T:
            nc = await bus.connect(self.url, "gateway-test")
            try:
                return await ask(nc)
            finally:
                await nc.close()

        return asyncio.run(go())

    def dataset_info(self, name: str):
        """The ``datasets`` object's info (its nuid changes when it is written again)."""
        return self._run(lambda nc: _datasets(nc, lambda store: store.get_info(name)))

    def dataset(self, name: str) -> bytes:
        return self._run(lambda nc: _datasets(nc, lambda store: store.get(name))).data

    def ask_trainer(self, subject: str, body: BaseModel | None, reply: type[Reply]) -> Reply:
        """The trainer's own answer, through the client the gateway uses."""
        return self._run(lambda nc: ServiceClient(nc, "trainer", 10).call(subject, body, reply))


async def _datasets(nc, use):
    return await use(await nc.jetstream().object_store(subjects.DATASETS_BUCKET))


@pytest.fixture(scope="module")
def nats_bus(nats_proc) -> Bus:
    return Bus(nats_proc.info["url"])
