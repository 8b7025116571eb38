"""A real PostgreSQL for the tests: a testcontainer where a Docker daemon answers, otherwise a
throwaway local cluster (the machines we run on have PostgreSQL installed but no Docker daemon)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator

from loopline.common.local.launcher import free_port

PASSWORD = "loopline"


def docker_available() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@contextlib.contextmanager
def _container() -> Iterator[str]:
    from testcontainers.postgres import PostgresContainer

    with PostgresContainer("postgres:16-alpine", driver="psycopg") as pg:
        yield pg.get_connection_url()


@contextlib.contextmanager
def _local_cluster() -> Iterator[str]:
    if not shutil.which("pg_createcluster"):
        raise RuntimeError("no Docker daemon and no local PostgreSQL (apt-get install postgresql)")
    version = sorted(p for p in subprocess.run(
        ["ls", "/usr/lib/postgresql"], capture_output=True, text=True).stdout.split())[-1]
    name = f"lt{uuid.uuid4().hex[:8]}"
    port = free_port()
    subprocess.run(["pg_createcluster", version, name, "--port", str(port)], check=True,
                   capture_output=True)
    try:
        subprocess.run(["pg_ctlcluster", version, name, "start"], check=True, capture_output=True)
        subprocess.run(
            ["su", "postgres", "-c", f"psql -p {port} -c \"ALTER USER postgres PASSWORD '{PASSWORD}'\""],
            check=True, capture_output=True,
        )
        yield f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(["pg_dropcluster", "--stop", version, name], capture_output=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yield a SQLAlchemy URL of a fresh, empty PostgreSQL database."""
    cm = _container() if docker_available() else _local_cluster()
    with cm as url:
        yield url
