"""Fixtures for the queue service tests: ledger databases (SQLite and PostgreSQL), a NATS client,
and the queue service started as a real process."""

from __future__ import annotations

import asyncio
import time
import uuid

import nats.errors
import pytest
import sqlalchemy as sa

from loopline.common.contracts import subjects
from loopline.common.db.engine import migrate, open_database
from loopline.common.local import launcher
from loopline.common.runtime import bus

QUEUE_STATUS = subjects.SVC_QUEUE_STATUS


@pytest.fixture
def pg_url(postgres_url):
    """A fresh, empty database on the session's PostgreSQL server, dropped after the test."""
    name = f"queue_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield postgres_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def engine(database_url):
    """A migrated ledger on ``database_url``."""
    eng = open_database(database_url)
    migrate(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def js(nc):
    return nc.jetstream()


@pytest.fixture
def start_queue(nats_url, tmp_path):
    """Start ``python -m loopline.queue`` as the stack does; waits until it answers requests.

    Call it as ``await start_queue(database_url=..., **{"MAX_QUEUE_DEPTH": "7"})``; the default
    ledger is SQLite under ``tmp_path``.
    """
    procs: list[launcher.Proc] = []

    async def start(database_url: str | None = None, **extra: str) -> launcher.Proc:
        env = {
            "LOOPLINE_NATS_URL": nats_url,
            "LOOPLINE_STATE_DIR": str(tmp_path),
            "LOOPLINE_STATE_INTERVAL_S": "0.1",
            **{f"LOOPLINE_{k.upper()}": v for k, v in extra.items()},
        }
        if database_url:
            env["LOOPLINE_DATABASE_URL"] = database_url
        proc = launcher.start_service("queue", env, tmp_path / "logs" / f"queue-{len(procs)}.log")
        procs.append(proc)
        await wait_ready(proc, nats_url)
        return proc

    yield start
    for proc in procs:
        launcher.stop(proc)


async def wait_ready(proc: launcher.Proc, nats_url: str, timeout_s: float = 30.0) -> None:
    nc = await bus.connect(nats_url, "queue-test-ready")
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"queue exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                await nc.request(QUEUE_STATUS, b"", timeout=0.5)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.05)
        raise TimeoutError(f"queue not ready after {timeout_s}s:\n{proc.log_tail()}")
    finally:
        await nc.close()


@pytest.fixture
def eventually():
    """``await eventually(check)``: call ``check`` (sync or async) until it returns something
    truthy without raising AssertionError, and return that; fail with the last error after a while."""

    async def poll(check, timeout_s: float = 15.0, interval_s: float = 0.05):
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = check()
                if asyncio.iscoroutine(value):
                    value = await value
                if value:
                    return value
            except AssertionError as exc:
                last = exc
            await asyncio.sleep(interval_s)
        raise AssertionError(f"condition not met within {timeout_s}s") from last

    return poll
