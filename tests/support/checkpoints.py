"""Announcing a checkpoint the way the checkpoint-watcher does, for tests that stand in for it:
the adapter files as a tar in the ``adapters`` object store, then a CheckpointAnnounce on
``checkpoints.<base>.<hash>``."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from pathlib import Path

from loopline.common import adapter_format, bus, subjects
from loopline.common.job_layout import checkpoint_step
from loopline.common.job_schemas import CheckpointAnnounce


def adapter_tar(checkpoint: Path) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name in adapter_format.FILES:
            data = (checkpoint / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


async def announce_checkpoint(js, checkpoint: Path, *, job_hash: str, base_model: str,
                              created_at: float | None = None) -> CheckpointAnnounce:
    config = json.loads((checkpoint / adapter_format.CONFIG_FILE).read_text())
    step = int(config.get("step") or checkpoint_step(checkpoint.name))
    data = adapter_tar(checkpoint)
    name = f"{job_hash}/{step}"
    obs = await js.object_store(subjects.ADAPTERS_BUCKET)
    await obs.put(name, data)
    announce = CheckpointAnnounce(
        job_hash=job_hash, step=step, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
        created_at=created_at if created_at is not None else time.time(), announced_at=time.time(),
        adapter_type=config["adapter_type"], base_model=base_model, object_name=name,
        adapter_config=config)
    await bus.publish_durable(js, subjects.checkpoint_subject(base_model, job_hash),
                              announce.model_dump_json().encode(),
                              msg_id=f"{job_hash}:{step}:{announce.sha256[:16]}")
    return announce
