"""Fixtures every test package can use (a real nats-server, a real PostgreSQL, a real Slurm), and the
tiers: each test is marked by what it starts (README "Tests"), so ``make test-fast`` can leave the
whole stacks, Slurm, chaos and soak runs to ``make test``."""

from __future__ import annotations

import os

import pytest

from loopline.common.local import launcher
from loopline.common.runtime import bus
from support.early_release import pytest_runtest_teardown  # noqa: F401 (a hook: stacks stop early)
from support.gateway_process import start_gateway
from support.nats import nats_server as _nats_server
from support.postgres import postgres_server
from support.slurm import slurm_available, slurm_cluster as _slurm_cluster
from support.tiers import leave_out_compose, mark_tiers


@pytest.fixture
def nats_server(tmp_path):
    with _nats_server(tmp_path) as proc:
        yield proc


@pytest.fixture
def nats_url(nats_server):
    return nats_server.info["url"]


@pytest.fixture(scope="module")
def nats_proc(tmp_path_factory):
    """One nats-server for a whole test module (the gateway's and the CLI's stacks share it)."""
    with _nats_server(tmp_path_factory.mktemp("nats")) as proc:
        yield proc


@pytest.fixture(scope="module")
def lone_gateway(nats_proc, tmp_path_factory):
    """The gateway as its own process on the module's nats-server, with no other service: for
    tests that put the records it reads on the bus themselves."""
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("gateway"))
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture
async def nc(nats_url):
    """A client of the test's nats-server, with Loopline's streams and buckets in place."""
    conn = await bus.connect(nats_url, "test")
    await bus.ensure_topology(conn.jetstream())
    yield conn
    await conn.close()


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


def pytest_collection_modifyitems(config, items):
    mark_tiers(items)
    leave_out_compose(config, items)
    # The model families' stack (six engines at its peak) first: in `make test` its lane then runs it
    # while the other lane has started few of its stacks. Run later, beside them, it took the last
    # of the memory and the kernel killed one of their engines.
    items.sort(key=lambda item: item.get_closest_marker("families") is None)
