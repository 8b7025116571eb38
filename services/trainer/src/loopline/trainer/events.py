"""Job events: each complete line of a job's events.jsonl becomes one JobEvent on
``events.jobs.<hash>.<kind>`` in the EVENTS stream, in file order, exactly once.

The line's number in the file is its ``seq``. The cursor (lines published, byte offset after them)
is stored in the job's row only after JetStream acknowledged those lines; lines published but not
yet recorded when the trainer dies are published again after the restart with the same
Nats-Msg-Id, and the stream's dedupe window drops the copies. So a restart neither repeats nor
skips an event.
"""

from __future__ import annotations

import asyncio
import json
import logging

from nats.js import JetStreamContext
from pydantic import ValidationError

from loopline.common.contracts import subjects
from loopline.common.contracts.hub_push import HubPush
from loopline.common.contracts.job_schemas import CheckpointInfo, JobEvent, JobStatus
from loopline.common.runtime import bus
from loopline.trainer import jobdir
from loopline.trainer.registry import Job, Registry

log = logging.getLogger(__name__)

# Lines read and published before the cursor is stored (bounds what a crash can republish), and
# about the most bytes of them held at once (at least one line is, up to its limit).
BATCH_LINES = 256
BATCH_BYTES = 4 * 1024 * 1024

STATUS_OF_KIND = {
    "queued": JobStatus.QUEUED,
    "started": JobStatus.TRAINING,
    "progress": JobStatus.TRAINING,
    "checkpoint": JobStatus.TRAINING,
    "completed": JobStatus.COMPLETED,
    "failed": JobStatus.FAILED,
    "cancelled": JobStatus.CANCELLED,
    "hub": JobStatus.COMPLETED,  # written by the trainer after the job completed (hub_loop.py)
}
FINAL_KIND = {JobStatus.COMPLETED: "completed", JobStatus.FAILED: "failed", JobStatus.CANCELLED: "cancelled"}
_FIELDS = ("step", "max_steps", "loss", "learning_rate", "tokens_per_s", "epoch", "error")


def event_from_line(job_hash: str, seq: int, line: bytes) -> JobEvent | None:
    """The JobEvent a line describes, or None for a line that is not one (logged, skipped)."""
    try:
        raw = json.loads(line)
        if not isinstance(raw, dict) or raw.get("kind") not in subjects.JOB_EVENT_KINDS:
            raise ValueError(f"no known kind: {str(raw)[:120]}")
        kind = raw["kind"]
        fields = {k: raw[k] for k in _FIELDS if raw.get(k) is not None}
        checkpoint = raw.get("checkpoint")
        if checkpoint is None and kind == "checkpoint" and "path" in raw:
            # The training program writes a checkpoint's step/path/created_at at the top level.
            checkpoint = {"step": raw.get("step"), "path": raw["path"],
                          "created_at": raw.get("created_at", raw.get("time"))}
        return JobEvent(
            job_hash=job_hash, kind=kind, seq=seq, time=raw.get("time") or 0.0,
            status=STATUS_OF_KIND[kind],
            checkpoint=CheckpointInfo.model_validate(checkpoint) if checkpoint else None,
            hub=HubPush.model_validate(raw["hub"]) if raw.get("hub") else None,
            **fields,
        )
    except (ValueError, ValidationError, RecursionError) as exc:
        log.warning("job %s: events.jsonl line %d is not an event, skipped: %s", job_hash, seq, exc)
        return None


class EventPublisher:
    def __init__(self, js: JetStreamContext, registry: Registry,
                 limits: jobdir.ReadLimits = jobdir.DEFAULT_LIMITS):
        self.js = js
        self.registry = registry
        self.max_line_bytes = limits.max_event_line_bytes

    async def publish_pending(self, job: Job, until: int | None = None) -> Job:
        """Publish every complete line after the job's cursor (up to byte ``until``, where the job's
        last event ends: reaching it marks its events done); returns the job with its cursor moved.
        Raises bus.BusUnavailable when NATS does not acknowledge (the cursor stays where it was), and
        jobdir.OverLimit at a line longer than the limit (then the job is failed, and its last lines
        are published with ``until``, passing over such lines)."""
        while True:
            lines, offset = await asyncio.to_thread(
                jobdir.read_events, job.job_dir, job.events_offset, BATCH_LINES, until,
                max_line_bytes=self.max_line_bytes, max_bytes=BATCH_BYTES, skip_long=until is not None)
            if not lines:
                return job
            seq = job.events_seq
            for line in lines:
                seq += 1
                event = event_from_line(job.job_hash, seq, line)
                if event is None:
                    continue
                await bus.publish_durable(
                    self.js, subjects.job_event(job.job_hash, event.kind), event.model_dump_json().encode(),
                    msg_id=f"{job.msg_id_prefix}:{seq}",
                )
            # One update: a cursor past the last event is never stored without "done" (or the
            # last event would be looked for, not found after the cursor, and written twice).
            done = {"events_done": True} if until is not None and offset >= until else {}
            job = await asyncio.to_thread(self.registry.update, job, events_seq=seq, events_offset=offset,
                                          **done)
            if done:
                return job

    async def publish_final(self, job: Job) -> Job:
        """For a job the trainer ended itself (cancelled, failed): publish its events up to and
        including the last one, writing that first if a crash came between marking the job finished
        and writing it. What the run wrote after it (a checkpoint on its way out) is not published."""
        kind = FINAL_KIND[job.status]
        end = await asyncio.to_thread(jobdir.find_event, job.job_dir, job.events_offset, kind,
                                      self.max_line_bytes)
        if end is None:
            end = await asyncio.to_thread(jobdir.append_event, job.job_dir, kind, status=job.status.value,
                                          step=job.step, error=job.error)
        return await self.publish_pending(job, until=end)
