"""A real nats-server with JetStream for one test, in a temporary directory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from loopline.common.local import launcher


@contextlib.contextmanager
def nats_server(tmp: Path) -> Iterator[launcher.Proc]:
    proc = launcher.start_nats(
        tmp / "nats", launcher.free_port(), launcher.free_port(), tmp / "logs" / "nats.log"
    )
    try:
        yield proc
    finally:
        launcher.stop(proc)


def restart(proc: launcher.Proc, tmp: Path) -> launcher.Proc:
    """Stop the server and start it again on the same port and data directory."""
    launcher.stop(proc)
    return launcher.start_nats(
        proc.info["data_dir"], proc.info["port"], proc.info["monitor_port"], tmp / "logs" / "nats.log"
    )
