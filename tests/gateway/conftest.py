"""A real nats-server, the gateway as its own process, and a stand-in trainer (support/fake_trainer.py)
answering svc.trainer.* — the gateway is what these tests exercise. One set per test module."""

from __future__ import annotations

import httpx
import pytest

from loopline.common import launcher
from support.fake_trainer import FakeTrainer
from support.gateway_process import start_gateway
from support.nats import nats_server


@pytest.fixture(scope="module")
def nats_proc(tmp_path_factory):
    with nats_server(tmp_path_factory.mktemp("nats")) as proc:
        yield proc


@pytest.fixture(scope="module")
def trainer(nats_proc):
    fake = FakeTrainer(nats_proc.info["url"]).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def gateway(nats_proc, trainer, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("gateway"))
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client
