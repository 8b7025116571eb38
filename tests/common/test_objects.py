"""Reading objects (runtime/objects.py) on a real nats-server: whole objects come back byte for
byte, and an object whose chunks are gone while its metadata stays is refused within the stall
time, where nats-py's own ``get`` waits for them forever (a CI run hung 900 s that way)."""

from __future__ import annotations

import io
import os
import time

import pytest
from nats.js.api import ObjectStoreConfig
from nats.js.errors import ObjectNotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from loopline.common.runtime import bus, objects

BUCKET = "objects-test"
STREAM = OBJ_STREAM_TEMPLATE.format(bucket=BUCKET)
# Three of nats-py's 128 KiB chunks, the last one short.
BIG = os.urandom(2 * 128 * 1024 + 1000)


@pytest.fixture
async def js(nats_url):
    nc = await bus.connect(nats_url, "test-objects")
    try:
        js = nc.jetstream()
        await js.create_object_store(BUCKET, ObjectStoreConfig())
        yield js
    finally:
        await nc.close()


async def test_whole_objects_come_back_into_memory_and_into_a_file(js, tmp_path):
    store = await js.object_store(BUCKET)
    await store.put("big", BIG)
    await store.put("empty", b"")
    assert await objects.read_bytes(js, BUCKET, "big") == BIG
    assert await objects.read_bytes(js, BUCKET, "empty") == b""
    with open(tmp_path / "big", "wb") as f:  # noqa: ASYNC230 - what the trainer does
        assert await objects.read_into(js, BUCKET, "big", f) == len(BIG)
    assert (tmp_path / "big").read_bytes() == BIG
    # Read many times: each read leaves no subscription behind on the client.
    subscriptions = len(js._nc._subs)
    for _ in range(20):
        assert await objects.read_bytes(js, BUCKET, "big") == BIG
    assert len(js._nc._subs) == subscriptions


async def test_a_missing_or_deleted_object_is_not_found(js):
    store = await js.object_store(BUCKET)
    with pytest.raises(ObjectNotFoundError) as missing:
        await objects.read_bytes(js, BUCKET, "never-put")
    assert not isinstance(missing.value, objects.ObjectGone)
    await store.put("deleted", b"x")
    await store.delete("deleted")
    with pytest.raises(ObjectNotFoundError) as deleted:
        await objects.read_bytes(js, BUCKET, "deleted")
    assert not isinstance(deleted.value, objects.ObjectGone)


async def _chunk_sequences(js, name: str) -> list[int]:
    store = await js.object_store(BUCKET)
    info = await store.get_info(name)
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=BUCKET, obj=info.nuid)
    first = await js.get_msg(STREAM, subject=subject, next=True, seq=1)
    return [first.seq + i for i in range(info.chunks)]


async def test_chunks_gone_under_kept_metadata_are_refused_within_the_stall_time(js):
    store = await js.object_store(BUCKET)
    await store.put("expired", BIG)
    chunks = await _chunk_sequences(js, "expired")
    assert len(chunks) == 3
    for seq in chunks:  # as max age does: the chunks go, the metadata written after them stays
        await js.delete_msg(STREAM, seq)
    await store.get_info("expired")  # the metadata is still there
    started = time.monotonic()
    with pytest.raises(objects.ObjectGone, match="no chunk for 1 s after 0 of"):
        await objects.read_bytes(js, BUCKET, "expired", stall_s=1.0)
    assert time.monotonic() - started < 5
    with pytest.raises(objects.ObjectGone):  # as the callers catch it: nats-py's not-found error
        await objects.read_into(js, BUCKET, "expired", io.BytesIO(), stall_s=1.0)


async def test_a_chunk_gone_from_the_front_does_not_pass_for_the_object(js):
    store = await js.object_store(BUCKET)
    await store.put("holed", BIG)
    first = (await _chunk_sequences(js, "holed"))[0]
    await js.delete_msg(STREAM, first)
    with pytest.raises(objects.ObjectGone, match="do not match"):
        await objects.read_bytes(js, BUCKET, "holed", stall_s=1.0)
