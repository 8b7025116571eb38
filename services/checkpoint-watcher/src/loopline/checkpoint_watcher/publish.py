"""What the watcher sends: the adapter object, the announcement on CHECKPOINTS, the rejected event.

Every step is idempotent, so the watcher can redo any of them after a crash or a NATS outage:
an object already stored with the same digest is not sent again, an announcement that is already
the last one of its subject is not repeated (this holds beyond the stream's dedupe window, which
the Nats-Msg-Id covers), and a rejected event carries a Nats-Msg-Id of the folder it is about.
"""

from __future__ import annotations

import base64
import json
import logging
import time

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from loopline.checkpoint_watcher.pack import Packed
from loopline.checkpoint_watcher.scan import StepDir
from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import AdapterEvent, CheckpointAnnounce
from loopline.common.runtime import adapter_retire, bus

log = logging.getLogger(__name__)

# A publish is retried through a NATS outage this long; then the job is retried at the next scan.
PUBLISH_DEADLINE_S = 10.0


object_name = adapter_retire.adapter_object_name


async def store_object(obs: ObjectStore, name: str, packed: Packed) -> None:
    digest = "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(packed.sha256)).decode()
    try:
        info = await obs.get_info(name)
        if info.digest == digest and info.size == packed.size:
            return  # stored by an earlier run that stopped before announcing it
    except NotFoundError:  # also a deleted object
        pass
    packed.data.seek(0)
    # nats-py reads any file with readinto (BytesIO, TemporaryFile); its annotation says BufferedIOBase.
    await obs.put(name, packed.data)  # type: ignore[arg-type]


async def announce(js: JetStreamContext, obs: ObjectStore, job_hash: str, base_model: str,
                   step_dir: StepDir, packed: Packed) -> CheckpointAnnounce | None:
    """Store and announce a checkpoint; None when its subject already ends with this very one."""
    name = object_name(job_hash, step_dir.step)
    await store_object(obs, name, packed)
    subject = subjects.checkpoint_subject(base_model, job_hash)
    if await _last_announced(js, subject) == (step_dir.step, packed.sha256):
        return None
    message = CheckpointAnnounce(
        job_hash=job_hash, step=step_dir.step, sha256=packed.sha256, size=packed.size,
        created_at=step_dir.created_at, announced_at=time.time(), adapter_type=packed.adapter_type,
        base_model=base_model, object_name=name, adapter_config=packed.config,
    )
    await bus.publish_durable(js, subject, message.model_dump_json().encode(),
                              msg_id=announce_msg_id(job_hash, step_dir, packed),
                              deadline_s=PUBLISH_DEADLINE_S)
    return message


def announce_msg_id(job_hash: str, step_dir: StepDir, packed: Packed) -> str:
    """The same folder gives the same id (a retried publish is dropped as a copy); the folder's time
    tells a job deleted and submitted again, whose checkpoint may have the very same bytes, from
    the first (its announcement would be dropped as a copy within the dedupe window)."""
    return f"{job_hash}:{step_dir.step}:{packed.sha256[:16]}:{int(step_dir.created_at * 1000)}"


async def reject(js: JetStreamContext, job_hash: str, step_dir: StepDir, reason: str) -> None:
    event = AdapterEvent(job_hash=job_hash, kind="rejected", step=step_dir.step, reason=reason,
                         path=str(step_dir.path))
    await bus.publish_durable(js, subjects.adapter_event(job_hash, "rejected"),
                              event.model_dump_json().encode(),
                              msg_id=f"{job_hash}:{step_dir.step}:rejected:{step_dir.fingerprint}",
                              deadline_s=PUBLISH_DEADLINE_S)


async def _last_announced(js: JetStreamContext, subject: str) -> tuple[int, str] | None:
    try:
        msg = await js.get_last_msg(subjects.CHECKPOINTS_STREAM, subject)
    except NotFoundError:
        return None
    try:
        data = json.loads(msg.data or b"{}")
        return data["step"], data["sha256"]
    except (ValueError, KeyError, TypeError):
        return None
