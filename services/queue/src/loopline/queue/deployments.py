"""Which deployments exist: the keys of the MODELS bucket, kept current by a watch.

A watch costs one consumer for as long as it runs, where listing the keys on every admission tick
would create and abandon one consumer per tick.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js import JetStreamContext

from loopline.common.contracts import subjects

log = logging.getLogger(__name__)

# The watch is rebuilt this often, so one lost to a nats-server restart heals itself.
REWATCH_S = 30.0
_DELETED = ("DEL", "PURGE")


class DeploymentDirectory:
    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._keys: frozenset[str] = frozenset()

    def keys(self) -> frozenset[str]:
        return self._keys

    async def run(self, stopping: asyncio.Event) -> None:
        # Invariant: ``_keys`` is the bucket's set of live keys as of the last update this watch
        # delivered; while a new watch replays the bucket, the previous set stays in place.
        while not stopping.is_set():
            watcher = None
            try:
                kv = await self._js.key_value(subjects.MODELS_BUCKET)
                # The server drops the watch's consumer a few seconds after we stop listening.
                watcher = await kv.watchall(inactive_threshold=5.0)
                await self._follow(watcher, stopping, time.monotonic() + REWATCH_S)
            except Exception as exc:  # noqa: BLE001 - NATS may be restarting; try again shortly
                log.warning("watching %s failed: %s", subjects.MODELS_BUCKET, exc)
                await asyncio.sleep(1.0)
            finally:
                if watcher is not None:
                    try:
                        await watcher.stop()
                    except Exception:  # noqa: BLE001
                        pass

    async def _follow(self, watcher, stopping: asyncio.Event, until: float) -> None:
        keys: set[str] = set()
        replaying = True
        while not stopping.is_set() and time.monotonic() < until:
            try:
                entry = await watcher.updates(timeout=0.5)
            except TimeoutError:  # nats.errors.TimeoutError subclasses it
                continue
            if entry is None:  # the watch has replayed what the bucket held when it started
                replaying = False
            elif entry.operation in _DELETED:
                keys.discard(entry.key)
            else:
                keys.add(entry.key)
            if not replaying:
                self._keys = frozenset(keys)
