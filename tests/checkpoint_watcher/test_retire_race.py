"""A job deleted while the watcher handles its checkpoint leaves nothing announced or stored.

The trainer's delete removes the job's folder, then retires it (adapter_retire.retire: CHECKPOINTS
and the adapters object store purged). The watcher may have read the checkpoint just before the
folder went and announce it just after the purge; it then finds the folder gone and retires the job
again. Here the real watcher (in-process, as service.py builds it) handles a job while the delete
runs, at many offsets between the two, on a real nats-server; after both, nothing of the job is left.
"""

from __future__ import annotations

import asyncio
import random
import uuid

from loopline.checkpoint_watcher.cursor import Cursors
from loopline.checkpoint_watcher.watcher import CheckpointWatcher
from loopline.common.contracts import subjects
from loopline.common.runtime import adapter_retire, bus
from loopline.trainer import jobdir

ROUNDS = 30


async def leftovers(js, job: str) -> tuple[list[str], int]:
    """The job's checkpoint subjects on CHECKPOINTS and its objects in the adapters store."""
    info = await js.stream_info(subjects.CHECKPOINTS_STREAM, subjects_filter=subjects.checkpoints_of_job(job))
    store = await js.object_store(subjects.ADAPTERS_BUCKET)
    try:
        objects = [o for o in await store.list(ignore_deletes=True)
                   if o.name.startswith(adapter_retire.adapter_objects_prefix(job))]
    except Exception:  # noqa: BLE001 - nats-py's NotFoundError for a store with no objects
        objects = []
    return list(info.state.subjects or {}), len(objects)


async def test_a_delete_racing_the_watcher_leaves_nothing_of_the_job(nats_url, jobs, jobs_dir):
    nc = await bus.connect(nats_url, "retire-race-test")
    try:
        js = nc.jetstream()
        await bus.ensure_topology(js)
        watcher = CheckpointWatcher(jobs_dir, 64 * 1024 * 1024, js,
                                    await js.object_store(subjects.ADAPTERS_BUCKET), await Cursors.open(js))
        rng = random.Random(16)
        # Invariant: every job of the rounds so far has nothing left in CHECKPOINTS or the store.
        for _ in range(ROUNDS):
            job = uuid.uuid4().hex * 2
            job_dir = jobs.job(job)
            jobs.checkpoint(job, 3)

            async def delete(job=job, job_dir=job_dir) -> None:
                await asyncio.sleep(rng.uniform(0, 0.03))
                await asyncio.to_thread(jobdir.remove, job_dir)  # the trainer's order: folder, then retire
                await adapter_retire.retire(js, job)

            await asyncio.gather(watcher.handle_job(job), delete())
            assert await leftovers(js, job) == ([], 0)
        print(f"\n{ROUNDS} rounds: {watcher.counts['announced']} announced before the delete's purge "
              f"or after it, {watcher.counts['withdrawn']} withdrawn by the watcher itself")
    finally:
        await nc.close()
