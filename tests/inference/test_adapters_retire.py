"""A deleted job's adapter retired on a replica (adapter_retire.retire, as the trainer's delete calls
it): unloaded from vLLM once no request pins it, refused afterwards, and a late announce of a
checkpoint written before the retirement not loaded again.

Real parts, as test_adapters_runtime.py (whose fixtures and helpers this uses): nats-server, vLLM's
server in-process on the tiny model, the replica's adapter manager and worker, a trained LoRA.
"""

from __future__ import annotations

import asyncio
import time
from importlib.util import find_spec

import pytest
from inference.test_adapters_runtime import (  # noqa: F401 - fixtures
    BASE,
    PAIRS,
    lora,
    nats,
    new_hash,
    next_event,
    step_dir,
    tiny,
    vllm,
)
from nats.js.errors import NotFoundError

from loopline.common.contracts import subjects
from loopline.common.runtime import adapter_retire
from support.checkpoints import announce_checkpoint

# Tier: a real vLLM engine per module, 10-20 s to start.
pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.slow]


async def wait_until(condition, timeout_s: float = 30.0) -> None:
    # Invariant: ``condition`` was false at every look so far.
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not true after {timeout_s} s")


# The module's fixtures are test_adapters_runtime's, imported: their names are parameters here.
async def test_retired_job_is_unloaded_once_unpinned_and_not_served_again(nats, vllm, lora):  # noqa: F811
    job = new_hash()
    events = await nats.events(job)
    checkpoint = step_dir(lora, 30)
    written = checkpoint.stat().st_mtime
    await announce_checkpoint(nats.js, checkpoint, job_hash=job, base_model=BASE, created_at=written)
    await next_event(events)
    llm = vllm.server.llm
    pinned = await vllm.manager.acquire(job)  # a request in flight, as the worker pins one

    await adapter_retire.retire(nats.js, job)
    await wait_until(lambda: job not in vllm.manager.loaded())
    # Pinned: still in vLLM, its files kept, until its request lets go.
    assert pinned.handle.lora_int_id in await llm.list_loras() and pinned.folder.exists()
    await vllm.manager.release(pinned)
    assert pinned.handle.lora_int_id not in await llm.list_loras() and not pinned.folder.exists()

    # A request naming it now: a clear 404 (its announcement is purged), not a reload.
    [refused] = await vllm.ask([PAIRS[0][0]], job)
    assert refused.status == 404 and refused.error is not None
    # The stores hold nothing of it.
    with pytest.raises(NotFoundError):
        await nats.js.get_last_msg(subjects.CHECKPOINTS_STREAM, subjects.checkpoint_subject(BASE, job))
    assert await _adapter_objects(nats.js, job) == 0

    # The watcher's race: a checkpoint written before the delete, announced after it. The replica
    # hears it and does not load it (whichever of the two messages it hears first).
    late = step_dir(lora, 27)
    await announce_checkpoint(nats.js, late, job_hash=job, base_model=BASE, created_at=late.stat().st_mtime)
    await asyncio.sleep(1.0)
    assert job not in vllm.manager.loaded() and job not in vllm.manager.announces
    [refused] = await vllm.ask([PAIRS[0][0]], job)
    assert refused.status == 404

    # The same hash submitted again (its checkpoints are written after the retirement) is served.
    await announce_checkpoint(nats.js, checkpoint, job_hash=job, base_model=BASE, created_at=time.time())
    assert (await next_event(events)).step == 30  # not 27: that one was never loaded
    assert vllm.manager.loaded()[job] == 30


async def _adapter_objects(js, job: str) -> int:
    """Objects of ``job`` in the adapters store, deleted ones included (purging leaves no marker)."""
    store = await js.object_store(subjects.ADAPTERS_BUCKET)
    try:
        infos = await store.list()
    except Exception:  # noqa: BLE001 - nats-py raises NotFoundError for an empty store
        return 0
    return sum(1 for info in infos if info.name.startswith(adapter_retire.adapter_objects_prefix(job)))
