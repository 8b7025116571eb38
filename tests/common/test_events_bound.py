"""EVENTS is bounded by LOOPLINE_EVENTS_MAX_BYTES, dropping its oldest events: a flood of events
(any client can make them: a run's metrics, a job's steps) can neither fill JetStream's store, so
that WORK and RESULTS publishes fail, nor be refused itself. On a real nats-server whose store is a
few MiB, as a small disk would be."""

from __future__ import annotations

import asyncio

import nats
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from loopline.common.config.settings import MiB
from loopline.common.contracts import subjects
from loopline.common.local import launcher
from loopline.common.runtime import bus, nats_auth, nats_permissions as roles

EVENTS_MAX_BYTES = 1 * MiB
STORE_BYTES = 6 * MiB  # the server's whole file store
EVENT_BYTES = 8 * 1024
FLOODED = 10 * MiB  # more than the whole store


async def test_a_flood_of_events_drops_the_oldest_and_leaves_the_store_to_work(tmp_path):
    config = tmp_path / "nats.conf"
    config.write_text(f"jetstream {{ max_file_store: {STORE_BYTES} }}\n")
    proc = launcher.start_nats(tmp_path / "nats", launcher.free_port(), launcher.free_port(),
                               tmp_path / "nats.log", config=config)
    nc = await bus.connect(proc.info["url"], "events-bound-test")
    try:
        js = nc.jetstream()
        # EVENTS as an older version made it, unbounded: starting brings it to the bound.
        await js.add_stream(StreamConfig(name=subjects.EVENTS_STREAM, subjects=[subjects.EVENTS_ALL],
                                         retention=RetentionPolicy.LIMITS, storage=StorageType.FILE))
        await bus.ensure_topology(js, retention=bus.Retention(3600, 0, 0, events_max_bytes=EVENTS_MAX_BYTES))
        bound = (await js.stream_info(subjects.EVENTS_STREAM)).config
        assert (bound.max_bytes, bound.discard) == (EVENTS_MAX_BYTES, DiscardPolicy.OLD)

        refused = await _flood(js, FLOODED // EVENT_BYTES)
        assert refused == [], f"{len(refused)} event publishes refused, first: {refused[:1]}"
        state = (await js.stream_info(subjects.EVENTS_STREAM)).state
        assert state.bytes <= EVENTS_MAX_BYTES
        assert state.last_seq == FLOODED // EVENT_BYTES and state.first_seq > 1  # the newest kept

        # What the flood would have starved: a request's work item and its answer.
        await js.publish(subjects.work("default"), b"{}", stream=subjects.WORK_STREAM)
        await js.publish(subjects.result("g-1", 0), b"{}", stream=subjects.RESULTS_STREAM)
    finally:
        await nc.close()
        launcher.stop(proc)


async def _flood(js, count: int) -> list[str]:
    """Publish ``count`` metrics-sized events, 64 at a time; the errors of those refused."""
    body = b"x" * EVENT_BYTES
    subject = subjects.session_event("flooder", "metrics")
    refused: list[str] = []

    async def one(i: int) -> None:
        try:
            await js.publish(subject, body, stream=subjects.EVENTS_STREAM)
        except Exception as exc:  # noqa: BLE001 - what the assertion reports
            refused.append(f"event {i}: {exc!r}")

    for start in range(0, count, 64):
        await asyncio.gather(*(one(i) for i in range(start, min(start + 64, count))))
    return refused


async def test_an_upgrade_bounds_events_once_the_queue_starts_and_others_start_before_it(tmp_path):
    """Under nats_permissions only the queue may update a stream. Before, a gateway (any service
    but the queue) started against the older, unbounded EVENTS failed its start on the refused
    update; now it starts, and the queue's start bounds EVENTS."""
    config, passwords = nats_auth.write_local_config(tmp_path)
    proc = launcher.start_nats(tmp_path / "nats", launcher.free_port(), launcher.free_port(),
                               tmp_path / "nats.log", config)
    clients = {role: await nats.connect(nats_auth.role_url(proc.info["url"], role, passwords[role]),
                                        allow_reconnect=False, connect_timeout=2)
               for role in (roles.GATEWAY, roles.QUEUE)}
    try:
        gateway, queue = (clients[r].jetstream(timeout=1.5) for r in (roles.GATEWAY, roles.QUEUE))
        older = bus.Retention(3600, 0, 0)
        await bus.ensure_topology(queue, retention=older)
        await queue.update_stream(StreamConfig(name=subjects.EVENTS_STREAM, subjects=[subjects.EVENTS_ALL],
                                               retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                                               max_age=7 * 24 * 3600, duplicate_window=bus.DEDUPE_WINDOW_S))
        bounded = bus.Retention(3600, 0, 0, events_max_bytes=EVENTS_MAX_BYTES)
        await bus.ensure_topology(gateway, retention=bounded)  # refused update: logged, start goes on
        assert (await gateway.stream_info(subjects.EVENTS_STREAM)).config.max_bytes == -1
        await bus.ensure_topology(queue, retention=bounded)
        assert (await gateway.stream_info(subjects.EVENTS_STREAM)).config.max_bytes == EVENTS_MAX_BYTES
    finally:
        for nc in clients.values():
            await nc.close()
        launcher.stop(proc)
