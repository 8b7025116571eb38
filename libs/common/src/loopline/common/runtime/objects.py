"""Reading one object out of a JetStream object store without ever waiting forever.

nats-py's ``ObjectStore.get`` reads the metadata, then waits on an ordered consumer until the
last chunk arrives. When the chunks are gone but the metadata is not, that wait never ends:
- a bucket's max age expires the chunks first (they are written before their metadata);
- a ``put`` over the same name purges the old chunks while a reader holds the old metadata (the
  upload plan is written again with every chunk).
A ``tests/common/test_retention.py`` run hung 900 s that way in CI. These readers give up once no
chunk has come for ``stall_s`` and say the object is gone, and they always stream into a sink:
nats-py's in-memory read joins the chunks onto one bytes object, quadratic in the object's size.
"""

from __future__ import annotations

import base64
import hashlib
import io
from typing import BinaryIO

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import ObjectNotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DIGEST_TYPE, OBJ_STREAM_TEMPLATE, ObjectStore

# A live server sends the next 128 KiB chunk within milliseconds of the last; 30 s of silence is
# far past a pause of a loaded server, and still short of the clients' own request timeouts.
CHUNK_STALL_S = 30.0


class ObjectGone(ObjectNotFoundError):
    """The metadata names chunks that are no longer there (expired, replaced) or do not match."""

    def __init__(self, description: str) -> None:
        super().__init__(description=description)

    def __str__(self) -> str:
        return self.description or "object gone"


async def read_into(js: JetStreamContext, bucket: str, name: str, sink: BinaryIO, *,
                    stall_s: float = CHUNK_STALL_S) -> int:
    """Write object ``name`` of ``bucket`` into ``sink``; returns its size. Raises nats-py's
    ObjectNotFoundError when there is no such object (or it was deleted), and ObjectGone, a
    subclass, when its chunks are gone or do not add up to what its metadata says."""
    store = ObjectStore(name=bucket, stream=OBJ_STREAM_TEMPLATE.format(bucket=bucket), js=js)
    info = await store.get_info(name)
    if info.is_link():
        raise ObjectGone(f"{bucket}/{name} is a link; links are not followed")
    if not info.size:
        return 0
    digest = hashlib.sha256()
    size = 0
    sub = await js.subscribe(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid),
                             ordered_consumer=True)
    try:
        # Invariant: ``sink`` and ``digest`` hold the chunks delivered so far, in stream order.
        while True:
            try:
                msg = await sub.next_msg(timeout=stall_s)
            except nats.errors.TimeoutError:
                raise ObjectGone(f"{bucket}/{name}: no chunk for {stall_s:g} s after {size} of "
                                 f"{info.size} bytes; its chunks are gone (expired or replaced)") from None
            sink.write(msg.data)
            digest.update(msg.data)
            size += len(msg.data)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    expected = base64.urlsafe_b64decode((info.digest or "").removeprefix(OBJ_DIGEST_TYPE))
    if size != info.size or digest.digest() != expected:
        raise ObjectGone(f"{bucket}/{name}: {size} bytes read do not match the {info.size} bytes "
                         f"and digest its metadata names; some chunks are gone (expired or replaced)")
    return size


async def read_bytes(js: JetStreamContext, bucket: str, name: str, *,
                     stall_s: float = CHUNK_STALL_S) -> bytes:
    """Object ``name`` of ``bucket`` in memory; raises as ``read_into`` does."""
    sink = io.BytesIO()
    await read_into(js, bucket, name, sink, stall_s=stall_s)
    return sink.getvalue()
