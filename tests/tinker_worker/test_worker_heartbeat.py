"""The session worker's heartbeat outlives a NATS that stops answering for a while.

A worker that exits loses every client's training state, so a heartbeat NATS did not answer must
not end it: on a machine swapping at load 100 one KV read timed out and a cookbook RL run lost its
client 12 iterations in. Here the real nats-server is paused (SIGSTOP) past the KV read timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from loopline.common.config.settings import TinkerWorkerSettings
from loopline.common.contracts.tinker_schemas import TinkerWorker
from loopline.common.runtime import bus
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.tinker_worker.worker import SessionWorker

WORKER_ID = "w-heartbeat"
# nats-py's JetStream requests (a KV read among them) give up after 5 s by default.
PAUSED_S = 7.0


async def recorded_beat(store: TinkerStore, after: float, timeout_s: float = 10) -> TinkerWorker:
    """The worker's record once it holds a beat later than ``after``."""
    deadline = time.monotonic() + timeout_s
    # Invariant: no record read so far holds a beat later than ``after``.
    while time.monotonic() < deadline:
        worker = await store.worker(WORKER_ID)
        if worker is not None and worker.heartbeat_at > after:
            return worker
        await asyncio.sleep(0.1)
    raise AssertionError(f"no heartbeat after {after} within {timeout_s} s")


# Tier: waits through heartbeats while NATS is stopped, ~7 s.
@pytest.mark.slow
async def test_the_heartbeat_goes_on_after_nats_stopped_answering(nats_server, nats_url):
    nc = await bus.connect(nats_url, "heartbeat-test")
    try:
        js = nc.jetstream()
        await bus.ensure_topology(js)
        store = TinkerStore(js, nc.max_payload)
        await store.start()
        await store.put_worker(TinkerWorker(worker_id=WORKER_ID, base_model="tiny", model_path="/tiny"))
        settings = TinkerWorkerSettings(tinker_worker_id=WORKER_ID, heartbeat_s=0.2)
        # The heartbeat reads only the settings, the store and the worker's models.
        worker = SessionWorker(rt=None, settings=settings, calls=None, store=store)  # type: ignore[arg-type]
        stopping = asyncio.Event()
        beating = asyncio.create_task(worker.heartbeat_loop(stopping))

        assert (await recorded_beat(store, after=0)).state == "ready"
        os.kill(nats_server.popen.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSED_S)
        finally:
            os.kill(nats_server.popen.pid, signal.SIGCONT)
        resumed = time.time()
        assert not beating.done(), beating.exception()
        await recorded_beat(store, after=resumed)

        stopping.set()
        await asyncio.wait_for(beating, timeout=10)
    finally:
        await nc.close()
