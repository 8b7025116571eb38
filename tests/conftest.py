"""Fixtures every test package can use: a real nats-server, a real PostgreSQL, a real Slurm."""

from __future__ import annotations

import os

import pytest

from support.nats import nats_server as _nats_server
from support.postgres import postgres_server
from support.slurm import slurm_available, slurm_cluster as _slurm_cluster


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


@pytest.fixture(scope="session")
def slurm():
    """A private single-node Slurm cluster (munged, slurmctld, slurmd) for the session; skips
    where Slurm is not installed (scripts/slurm/install.sh), or fails with LOOPLINE_REQUIRE_SLURM=1
    (CI). Use ``slurm.env`` for its clients."""
    why = slurm_available()
    if why and os.environ.get("LOOPLINE_REQUIRE_SLURM") == "1":
        pytest.fail(f"LOOPLINE_REQUIRE_SLURM=1 but {why}")
    if why:
        pytest.skip(why)
    with _slurm_cluster() as cluster:
        yield cluster
