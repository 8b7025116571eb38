"""Standing-credit pulls (credits.py) against a real nats-server: never more messages than the
capacity asked for, freed capacity asked for again, expired pulls renewed, and pulls lost to a
crashed and restarted NATS noticed and replaced."""

from __future__ import annotations

import asyncio
import time

import pytest

from loopline.common import bus, launcher, subjects
from loopline.inference.credits import CreditPull
from support import nats as nats_support

pytestmark = pytest.mark.asyncio
DEPLOYMENT = "credits"


class Holder:
    """Takes messages up to ``limit`` and keeps them unacked, as a busy replica would."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = []
        self.arrived = asyncio.Event()

    def free(self) -> int:
        return self.limit - len(self.held)

    def take(self, msg) -> None:
        self.held.append(msg)
        self.arrived.set()

    async def wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.held) < count:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), timeout=max(0.01, deadline - time.monotonic()))


async def _setup(url: str):
    nc = await bus.connect(url, "credits-test")
    js = nc.jetstream()
    await bus.ensure_topology(js)
    await bus.ensure_work_consumer(js, DEPLOYMENT, ack_wait_s=30, max_deliver=3)
    return nc, js


async def _publish(js, count: int, tag: str) -> None:
    for i in range(count):
        # Retries through a restarting server, as the gateway's publishes do.
        await bus.publish_durable(js, subjects.work(DEPLOYMENT), f"{tag}-{i}".encode(), msg_id=f"{tag}-{i}",
                                  deadline_s=20)


async def test_never_more_than_capacity_and_freed_capacity_is_asked_again(tmp_path):
    with nats_support.nats_server(tmp_path) as proc:
        nc, js = await _setup(proc.info["url"])
        holder = Holder(limit=3)
        pull = CreditPull(nc, subjects.WORK_STREAM, subjects.inference_durable(DEPLOYMENT),
                          capacity=holder.free, on_message=holder.take)
        await pull.start()
        try:
            await _publish(js, 5, "a")
            await holder.wait_for(3, timeout=5)
            await asyncio.sleep(0.5)
            assert len(holder.held) == 3, "more messages came than the capacity asked for"
            # Two finish: exactly the two still queued come, in stream order.
            for msg in holder.held[:2]:
                await msg.ack()
            holder.held = holder.held[2:]
            pull.changed.set()
            await holder.wait_for(3, timeout=5)
            assert [m.data for m in holder.held] == [b"a-2", b"a-3", b"a-4"]
        finally:
            await pull.stop()
            await nc.close()


async def test_an_expired_pull_is_renewed(tmp_path):
    with nats_support.nats_server(tmp_path) as proc:
        nc, js = await _setup(proc.info["url"])
        holder = Holder(limit=4)
        pull = CreditPull(nc, subjects.WORK_STREAM, subjects.inference_durable(DEPLOYMENT),
                          capacity=holder.free, on_message=holder.take, expires_s=0.3)
        await pull.start()
        try:
            await asyncio.sleep(1.5)  # several pulls expire unused (408), each handing its credit back
            assert pull.outstanding == 4
            started = time.monotonic()
            await _publish(js, 1, "late")
            await holder.wait_for(1, timeout=5)
            assert time.monotonic() - started < 1.0
            assert holder.held[0].data == b"late-0"
        finally:
            await pull.stop()
            await nc.close()


async def test_pulls_lost_to_a_nats_restart_are_asked_for_again(tmp_path):
    with nats_support.nats_server(tmp_path) as first:
        nc, js = await _setup(first.info["url"])
        holder = Holder(limit=4)
        pull = CreditPull(nc, subjects.WORK_STREAM, subjects.inference_durable(DEPLOYMENT),
                          capacity=holder.free, on_message=holder.take)
        await pull.start()
        second = None
        try:
            await asyncio.sleep(0.3)
            assert pull.outstanding == 4
            # A crash: no "409 Server Shutdown" hands the credit back (a clean stop sends one).
            first.popen.kill()
            first.popen.wait()
            second = nats_support.restart(first, tmp_path)  # the new server knows no waiting pull
            await _publish(js, 2, "after")
            # Noticed by the reconnect, well before a pull's lifetime of silence would tell.
            await holder.wait_for(2, timeout=4)
            assert sorted(m.data for m in holder.held) == [b"after-0", b"after-1"]
        finally:
            await pull.stop()
            await nc.close()
            if second is not None:
                launcher.stop(second)
