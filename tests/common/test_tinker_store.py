"""The Tinker records' store on a real nats-server: listing leaves nothing behind on the server
(the trainer lists the session workers every reconcile pass), a checkpoint listing holds one
run's checkpoints only, and a payload too big for a message comes back whole from the blob store."""

from __future__ import annotations

import os

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.tinker_schemas import TinkerCheckpoint, TinkerWorker
from loopline.common.runtime import bus
from loopline.common.runtime.tinker_store import TinkerStore


async def test_listing_leaves_no_consumers_and_filters_by_run(nats_url):
    nc = await bus.connect(nats_url, "test-tinker-store")
    try:
        js = nc.jetstream()
        await bus.ensure_topology(js)
        store = TinkerStore(js, nc.max_payload)
        await store.start()
        for _ in range(3):
            worker = TinkerWorker(worker_id=tinker_names.new_id(), base_model="m", model_path="/m")
            await store.put_worker(worker)
        runs = [tinker_names.model_id(tinker_names.new_id(), i) for i in range(2)]
        for run in runs:
            for name in ("a", "b"):
                path = tinker_names.TinkerPath(run, "weights", name)
                checkpoint = TinkerCheckpoint(model_id=run, checkpoint_type="training", name=name,
                                              tinker_path=str(path))
                await store.put_checkpoint(checkpoint, "weights")
        await store.delete_checkpoint(runs[1], "weights", "b")
        for _ in range(50):
            assert len(await store.workers()) == 3
        assert [c.name for c in await store.checkpoints(runs[0])] == ["a", "b"]
        assert [c.name for c in await store.checkpoints(runs[1])] == ["a"]
        for bucket in (subjects.TINKER_WORKERS_BUCKET, subjects.TINKER_CHECKPOINTS_BUCKET):
            info = await js.stream_info(f"KV_{bucket}")
            assert info.state.consumer_count == 0, bucket
    finally:
        await nc.close()


async def test_a_payload_past_a_message_goes_through_the_blob_store(nats_url):
    nc = await bus.connect(nats_url, "test-tinker-store")
    try:
        js = nc.jetstream()
        await bus.ensure_topology(js)
        store = TinkerStore(js, nc.max_payload)
        await store.start()
        small, big = b"s" * 100, os.urandom(store.max_inline + 300_000)
        assert (await store.pack("small", small)).blob is None
        packed = await store.pack("big", big)
        assert packed.blob is not None and packed.size == len(big)
        assert await store.unpack(await store.pack("small", small)) == small
        assert await store.unpack(packed) == big
    finally:
        await nc.close()
