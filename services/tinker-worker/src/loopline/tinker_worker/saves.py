"""Where a session worker's saves go, and how a sampler save reaches the inference replicas.

A sampler save is written as a training job's checkpoint (``tinker_names`` says why): a job
directory named by its adapter hash, with a job's ``config.json`` (``JobConfig``) naming the base
model and the adapter in ``checkpoints/step-%08d``, written into a ``.tmp-`` folder and renamed into
place. The
checkpoint-watcher announces it on ``checkpoints.<base>.<hash>``; ``wait_announced`` is how the
worker learns that the replicas can load it, without holding up the calls that come next.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from loopline.common.atomic_files import atomic_dir
from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, checkpoint_name, checkpoint_temp_prefix
from loopline.common.contracts.job_schemas import AdapterEvent, CheckpointAnnounce
from loopline.common.contracts.train_params import JobConfig, TrainParams


def write_sampler_checkpoint(jobs_dir: Path, adapter_hash: str, *, base_model: str, model_path: str,
                             step: int, write: Callable[[Path], None]) -> Path:
    """The checkpoint folder of one sampler save; ``write`` fills an empty folder with the adapter."""
    job_dir = jobs_dir / adapter_hash
    (job_dir / CHECKPOINTS_DIR).mkdir(parents=True, exist_ok=True)
    JobConfig(job_hash=adapter_hash, model_path=model_path,
              params=TrainParams(llm_name=base_model)).write(job_dir)
    return _install(job_dir / CHECKPOINTS_DIR, checkpoint_name(step), checkpoint_temp_prefix(step), write)


def write_state(folder: Path, write: Callable[[Path], None]) -> Path:
    """A ``save_state`` folder, replaced whole: a reader never sees half of one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return _install(folder.parent, folder.name, f".tmp-{folder.name}-", write)


def _install(parent: Path, name: str, temp_prefix: str, write: Callable[[Path], None]) -> Path:
    # An overwrite replaces the old folder whole. mode=None: the folder stays private, as
    # tempfile.mkdtemp made it.
    with atomic_dir(parent / name, temp_prefix=temp_prefix, mode=None) as temp:
        write(temp)
    return parent / name


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


class NotAnnounced(Exception):
    """The checkpoint-watcher refused the checkpoint, or did not announce it in time."""


async def wait_announced(nc: NATS, js: JetStreamContext, base_model: str, adapter_hash: str, step: int,
                         timeout_s: float) -> CheckpointAnnounce:
    """The announcement of ``adapter_hash`` at ``step``: once it exists, any replica can load it."""
    subject = subjects.checkpoint_subject(base_model, adapter_hash)
    heard: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        heard.put_nowait(msg)

    # Listen first, then look: an announcement made between the two is heard.
    announced = await nc.subscribe(subject, cb=on_msg)
    rejected = await nc.subscribe(subjects.adapter_event(adapter_hash, "rejected"), cb=on_msg)
    try:
        try:
            last = await js.get_last_msg(subjects.CHECKPOINTS_STREAM, subject)
            found = CheckpointAnnounce.model_validate_json(last.data or b"")
            if found.step == step:
                return found
        except NotFoundError:
            pass
        deadline = time.monotonic() + timeout_s
        # Invariant: nothing heard so far announced or rejected this step.
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await asyncio.wait_for(heard.get(), timeout=left)
            except TimeoutError:
                break
            if msg.subject == subject:
                found = CheckpointAnnounce.model_validate_json(msg.data)
                if found.step == step:
                    return found
            else:
                event = AdapterEvent.model_validate_json(msg.data)
                if event.step == step:
                    raise NotAnnounced(f"the checkpoint was rejected: {event.reason}")
        raise NotAnnounced(f"the checkpoint-watcher did not announce it within {timeout_s:.0f} s; is it "
                           "running, and does it watch this jobs directory?")
    finally:
        await announced.unsubscribe()
        await rejected.unsubscribe()
