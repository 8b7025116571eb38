"""Fixtures every test package can use: a real nats-server, a real PostgreSQL."""

from __future__ import annotations

import pytest

from support.nats import nats_server as _nats_server
from support.postgres import postgres_server


@pytest.fixture
def nats_server(tmp_path):
    with _nats_server(tmp_path) as proc:
        yield proc


@pytest.fixture
def nats_url(nats_server):
    return nats_server.info["url"]


@pytest.fixture(scope="session")
def postgres_url():
    with postgres_server() as url:
        yield url
