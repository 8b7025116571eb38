"""Waiting for results by id: heard as they arrive, looked up where they are stored.

Every result the gateway waits for is both stored (RESULTS, TINKER_FUTURES) and published on core
NATS as it is stored. A waiter listens first and then looks in the store, so that a result stored
between the two is heard, and looks again every ``RECHECK_S``: core messages are lost while NATS
reconnects. This is the one place that is written; the waits built on it are a group's results
(ScalarLM, Tinker samples: results.py), an OpenAI request's result beside its stream
(openai/api.py) and a Tinker training future (tinker/part.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, TypeVar

# While waiting, results we may have missed (a NATS reconnect drops core messages) are looked up.
RECHECK_S = 1.0

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


class Arrivals(Generic[K, R]):
    """Results by key, from the subscription (``heard``) or the store (``look_up``)."""

    def __init__(self, look_up: Callable[[K], Awaitable[R | None]]):
        self.look_up = look_up  # the stored result of a key, or None (not there yet)
        self.found: dict[K, R] = {}
        self._woken = asyncio.Event()

    def heard(self, key: K, result: R) -> None:
        """A result heard on core NATS (from the subscription's callback); the first one counts."""
        self.found.setdefault(key, result)
        self._woken.set()

    def wake(self) -> None:
        """Something else a waiter's ``until`` looks at has happened (a stream event arrived)."""
        self._woken.set()

    async def look_up_missing(self, keys: Iterable[K]) -> None:
        missing = [k for k in keys if k not in self.found]
        stored = await asyncio.gather(*(self.look_up(k) for k in missing))
        for key, result in zip(missing, stored, strict=True):
            if result is not None:
                self.found.setdefault(key, result)

    async def wait(self, keys: Iterable[K], timeout_s: float, *, stored_first: bool = True,
                   until: Callable[[], bool] | None = None) -> dict[K, R]:
        """The results of ``keys`` found within ``timeout_s``, returned as soon as every key has one
        (or ``until()`` holds). ``stored_first``: look in the store before waiting (a caller that
        has just published the request knows there is nothing there yet)."""
        wanted = set(keys)
        if stored_first:
            await self.look_up_missing(wanted)
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + RECHECK_S
        # Invariant: self.found holds every result heard or looked up so far, and the store was
        # looked in at most RECHECK_S ago; we return once it covers every wanted key, until()
        # holds, or the deadline passes.
        while not wanted.issubset(self.found) and not (until is not None and until()):
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_check:
                await self.look_up_missing(wanted)
                next_check = now + RECHECK_S
                continue
            self._woken.clear()
            try:
                await asyncio.wait_for(self._woken.wait(), timeout=min(deadline, next_check) - now)
            except TimeoutError:
                pass
        return {k: self.found[k] for k in wanted if k in self.found}
