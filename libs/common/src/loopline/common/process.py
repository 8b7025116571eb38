"""What every service's ``__main__`` does before its loop: logging, then running the loop.

The loop is uvloop's where it is installed (every Loopline image installs it): on a small machine
the gateway, NATS, the queue and a replica share the cores the engine leaves, and uvloop spends
less of them per message and per socket than asyncio's pure-Python loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def setup_logging(role: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # Windows, or an install without it: asyncio's loop works the same
        return asyncio.run(main)
    return uvloop.run(main)
