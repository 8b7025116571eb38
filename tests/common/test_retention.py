"""Retention of RESULTS, the ``datasets`` and the ``adapters`` object stores (bus.Retention, from
LOOPLINE_*_MAX_AGE_S): ensure_topology applies it to what exists already, and old entries go while
newer ones stay. On a real nats-server, with a retention of a few seconds."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import NotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from loopline.common.config.settings import CommonSettings
from loopline.common.contracts import subjects
from loopline.common.runtime import bus, objects
from support.nats import nats_server

SHORT_S = 3.0


def test_defaults_are_what_the_settings_say():
    retention = bus.Retention.of(CommonSettings())
    assert retention == bus.Retention(results_max_age_s=24 * 3600, datasets_max_age_s=30 * 24 * 3600,
                                      adapters_max_age_s=0)


@pytest.mark.slow  # waits out a TTL
@pytest.mark.asyncio
async def test_old_entries_go_and_newer_ones_stay(tmp_path):
    with nats_server(tmp_path) as proc:
        nc = await bus.connect(proc.info["url"], "retention-test")
        try:
            js = nc.jetstream()
            # Created with the defaults first (as an older stack left it), then brought to a short one.
            await bus.ensure_topology(js, retention=bus.Retention.of(CommonSettings()))
            short = bus.Retention(SHORT_S, SHORT_S, SHORT_S)
            await bus.ensure_topology(js, retention=short)
            for stream in (subjects.RESULTS_STREAM, *(OBJ_STREAM_TEMPLATE.format(bucket=b) for b in (
                    subjects.DATASETS_BUCKET, subjects.ADAPTERS_BUCKET))):
                assert (await js.stream_info(stream)).config.max_age == pytest.approx(SHORT_S)
            datasets = await js.object_store(subjects.DATASETS_BUCKET)
            adapters = await js.object_store(subjects.ADAPTERS_BUCKET)

            async def put(tag: str) -> None:
                await js.publish(subjects.result(f"group-{tag}", 0), tag.encode())
                await datasets.put(f"data-{tag}", tag.encode() * 1000)
                await adapters.put(f"job-{tag}/1", tag.encode() * 1000)

            await put("old")
            await asyncio.sleep(SHORT_S / 2)
            await put("new")
            # Invariant: some old entry was there at every look so far (the server expires each
            # within about a second of its max age).
            for _ in range(int((SHORT_S + 10) / 0.2)):
                if not await _has(js, "old"):
                    break
                await asyncio.sleep(0.2)
            assert not await _has(js, "old")
            # The newer ones are younger than the retention still (written SHORT_S / 2 later).
            assert await _all(js, "new")

            # Back to keeping forever (0): the object stores follow too.
            await bus.ensure_topology(js, retention=bus.Retention(SHORT_S, 0, 0))
            info = await js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=subjects.ADAPTERS_BUCKET))
            assert info.config.max_age == 0
        finally:
            await nc.close()


async def _present(js, tag: str) -> list[bool]:
    found = []
    try:
        await js.get_last_msg(subjects.RESULTS_STREAM, subjects.result(f"group-{tag}", 0))
        found.append(True)
    except NotFoundError:
        found.append(False)
    for bucket, name in ((subjects.DATASETS_BUCKET, f"data-{tag}"),
                         (subjects.ADAPTERS_BUCKET, f"job-{tag}/1")):
        try:
            # The product's reader: nats-py's get waits forever when the chunks expire before
            # their metadata, as they do (written first); this test hung 900 s in CI on that.
            await objects.read_bytes(js, bucket, name, stall_s=2.0)
            found.append(True)
        except NotFoundError:  # ObjectGone too
            found.append(False)
    return found


async def _has(js, tag: str) -> bool:
    return any(await _present(js, tag))


async def _all(js, tag: str) -> bool:
    return all(await _present(js, tag))


@pytest.mark.slow  # waits out a TTL
@pytest.mark.asyncio
async def test_tinker_sessions_go_unless_written_again(tmp_path):
    """TINKER_SESSIONS and TINKER_SAMPLERS keep a record LOOPLINE_TINKER_SESSIONS_MAX_AGE_S past its
    last write (buckets made before the TTL are brought to it): an abandoned session goes, one
    heartbeated (written again) stays."""
    with nats_server(tmp_path) as proc:
        nc = await bus.connect(proc.info["url"], "retention-test")
        try:
            js = nc.jetstream()
            await bus.ensure_topology(js, retention=bus.Retention.of(CommonSettings()))
            await bus.ensure_topology(js, retention=bus.Retention(SHORT_S, 0, 0, SHORT_S))
            sessions = await js.key_value(subjects.TINKER_SESSIONS_BUCKET)
            samplers = await js.key_value(subjects.TINKER_SAMPLERS_BUCKET)
            for bucket in (subjects.TINKER_SESSIONS_BUCKET, subjects.TINKER_SAMPLERS_BUCKET):
                assert (await js.stream_info(f"KV_{bucket}")).config.max_age == pytest.approx(SHORT_S)
            for kv in (sessions, samplers):
                await kv.put("abandoned", b"{}")
                await kv.put("in-use", b"{}")
            # Invariant: "in-use" was last written less than SHORT_S ago at every look.
            for _ in range(int((SHORT_S + 10) / 0.5)):
                await asyncio.sleep(0.5)
                for kv in (sessions, samplers):
                    await kv.put("in-use", b"{}")  # a heartbeat, a use
                if not await _kv_has(sessions, "abandoned") and not await _kv_has(samplers, "abandoned"):
                    break
            for kv in (sessions, samplers):
                assert not await _kv_has(kv, "abandoned") and await _kv_has(kv, "in-use")
        finally:
            await nc.close()


async def _kv_has(kv, key: str) -> bool:
    try:
        return (await kv.get(key)).value is not None
    except NotFoundError:
        return False
