"""Announcing a checkpoint folder for tests that stand in for the checkpoint-watcher process, through
the watcher's own functions: packed and checked by ``pack.pack`` (the adapter files as a
deterministic tar), stored in the ``adapters`` object store and announced on
``checkpoints.<base>.<hash>`` by ``publish.announce``. Only the scan is left out: the test names
the folder and its creation time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loopline.checkpoint_watcher.pack import pack
from loopline.checkpoint_watcher.publish import announce
from loopline.checkpoint_watcher.scan import StepDir
from loopline.common.config.settings import CheckpointWatcherSettings
from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import checkpoint_step
from loopline.common.contracts.job_schemas import CheckpointAnnounce

MAX_ADAPTER_BYTES = CheckpointWatcherSettings.model_fields["max_adapter_bytes"].default


async def announce_checkpoint(js, checkpoint: Path, *, job_hash: str, base_model: str,
                              created_at: float | None = None) -> CheckpointAnnounce | None:
    """Store and announce ``checkpoint`` (a ``step-XXXXXXXX`` folder) as the watcher would on
    finding it: the announcement sent, or None when it is already the job's last one (the stack's
    own watcher announced it first; announcing it again would repeat nothing)."""
    step = checkpoint_step(checkpoint.name)
    assert step is not None, f"{checkpoint.name} is not a checkpoint folder's name"
    packed = await asyncio.to_thread(pack, checkpoint, step, MAX_ADAPTER_BYTES)
    try:
        found = StepDir(step=step, path=checkpoint, fingerprint=f"test-{time.time_ns()}",
                        created_at=created_at if created_at is not None else time.time())
        obs = await js.object_store(subjects.ADAPTERS_BUCKET)
        return await announce(js, obs, job_hash, base_model, found, packed)
    finally:
        packed.data.close()
