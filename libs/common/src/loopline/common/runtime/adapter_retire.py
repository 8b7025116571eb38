"""Retiring a deleted job's adapter: what is purged, and the announcement everyone acts on.

Deleting a job (the trainer's ``delete``) ends with ``retire``: the job's checkpoint announcements
(``checkpoints.*.<hash>`` on CHECKPOINTS), its adapter objects (``<hash>/<step>`` in the ``adapters``
object store) and its adapter events (``loaded``, ``rejected``) are purged, then
``events.adapters.<hash>.retired`` is published, last, so whoever acts on it finds the stores clean.

The announcement's contract (an AdapterEvent of kind ``retired``): every checkpoint of the job written
before its ``time`` is withdrawn. An inference replica unloads the job's adapter once no request pins
it and loads no announce of it written before then; a gateway stops listing and routing the job and
answers a request naming it 404 "deleted". A checkpoint written later belongs to a job submitted
again under the same hash (the hash is of its data and params) and is served as usual.

The checkpoint-watcher may have read a checkpoint of the job just before its folder went and announce
it just after the purge; it then finds the folder gone and calls ``retire`` again (watcher.py), so
the late announcement is withdrawn too, and the rule above keeps replicas and gateways from reviving
it whichever message they hear first.
"""

from __future__ import annotations

import logging
import time

from nats.js import JetStreamContext

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import AdapterEvent
from loopline.common.runtime import bus

log = logging.getLogger(__name__)

# The retired event is retried through a NATS outage this long (the delete that sends it waits).
PUBLISH_DEADLINE_S = 30.0


def adapter_objects_prefix(job_hash: str) -> str:
    return f"{job_hash}/"


def adapter_object_name(job_hash: str, step: int) -> str:
    """The name of a job's checkpoint in the ``adapters`` object store."""
    return f"{adapter_objects_prefix(job_hash)}{step}"


async def retire(js: JetStreamContext, job_hash: str, *, at: float | None = None) -> AdapterEvent:
    """Purge what announces or holds the job's adapter, then announce it retired (see the module's
    docstring). Idempotent: a second call purges nothing more and announces again, harmlessly."""
    await js.purge_stream(subjects.CHECKPOINTS_STREAM, subject=subjects.checkpoints_of_job(job_hash))
    objects = await bus.purge_objects(js, subjects.ADAPTERS_BUCKET, adapter_objects_prefix(job_hash))
    await js.purge_stream(subjects.EVENTS_STREAM, subject=subjects.adapter_events(job_hash))
    event = AdapterEvent(job_hash=job_hash, kind="retired", time=at or time.time(), reason="deleted")
    await bus.publish_durable(js, subjects.adapter_event(job_hash, "retired"),
                              event.model_dump_json().encode(),
                              msg_id=f"{job_hash}:retired:{event.time:.6f}", deadline_s=PUBLISH_DEADLINE_S)
    log.info("job %s retired: its checkpoint announcements, %d adapter objects and adapter events "
             "purged", job_hash[:12], objects)
    return event
