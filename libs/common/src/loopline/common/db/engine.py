"""Database engine creation and schema migration (alembic), for SQLite and PostgreSQL alike."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text

MIGRATIONS = Path(__file__).with_name("migrations")


def normalise_url(url: str) -> str:
    """Accept plain ``postgresql://`` URLs and use the psycopg 3 driver we ship."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def open_database(url: str) -> Engine:
    """The SQL database at ``url`` (SQLite or PostgreSQL) as a SQLAlchemy engine (a connection pool)."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            # WAL lets readers (metrics queries) run while the ledger writer commits.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision; safe to run from several processes at start
    (the queue and the trainer share one database and start together)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with _migration_lock(engine), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Held to the end of the transaction: a second migrator waits, then finds it done.
            conn.execute(text("SELECT pg_advisory_xact_lock(20240331)"))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """SQLite runs DDL outside transactions, so two processes migrating an empty file at once
    would both create the tables: serialise them with a lock file next to the database."""
    path = engine.url.database if engine.url.get_backend_name() == "sqlite" else None
    if not path or path == ":memory:":
        yield
        return
    with open(f"{path}.migrate-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
