"""The trainer's hub loop: push each COMPLETED job whose params ask for ``push_to_hub``, record the
outcome in its row (JobInfo.hub), and tell its followers with a ``hub`` event.

For one job, in its row's ``hub_state`` (registry.HUB_*):
  pending      set by the reconcile step that marks the job COMPLETED: push (outside the job's lock:
               a large model takes minutes), then, under it, append the ``hub`` event to events.jsonl
               and store the outcome: unpublished;
  unpublished  publish the event (the job's cursor moves past it): done. NATS down: tried again.
A failed push is an outcome like a pushed one: the job stays COMPLETED and says why in ``hub.error``.
A trainer that dies mid-push pushes again after its restart (the commit then changes nothing).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from loopline.common.contracts.hub_push import HubPush
from loopline.common.contracts.job_schemas import JobStatus
from loopline.common.runtime import bus
from loopline.common.runtime.service import pause
from loopline.trainer import jobdir
from loopline.trainer.control import JobControl
from loopline.trainer.hub_push import HubPusher
from loopline.trainer.registry import HUB_DONE, HUB_PENDING, HUB_UNPUBLISHED, Job

log = logging.getLogger(__name__)

HUB_EVENT = "hub"


def hub_pending(job: Job) -> dict[str, Any]:
    """The row changes that make the job's push due, for the update that marks it COMPLETED; none
    when its params ask for no push."""
    request = job.params.push_to_hub
    if request is None:
        return {}
    return {"hub": HubPush(repo_id=request.repo_id, revision=request.revision, status="pending"),
            "hub_state": HUB_PENDING}


async def hub_loop(control: JobControl, pusher: HubPusher, stopping: asyncio.Event,
                   interval_s: float) -> None:
    """Push every due job, every ``interval_s``, until ``stopping``."""
    # Invariant: every COMPLETED job with push_to_hub has hub_state pending, unpublished or done;
    # each pass moves every job it finds one state on (a failure leaves it where it was, for the
    # next pass). A job deleted meanwhile is left alone.
    while not stopping.is_set():
        try:
            jobs = await asyncio.to_thread(control.registry.to_push)
            for job in jobs:
                if stopping.is_set():
                    break
                try:
                    await push_job(control, pusher, job)
                except bus.BusUnavailable as exc:
                    log.warning("job %s: hub event not published yet: %s", job.job_hash, exc)
                except Exception:  # one broken job must not stop the others
                    log.exception("job %s: hub push step failed", job.job_hash)
        except Exception:  # the database is down: try again next time
            log.exception("hub pass failed")
        await pause(stopping, interval_s)


async def push_job(control: JobControl, pusher: HubPusher, job: Job) -> None:
    if job.hub_state == HUB_PENDING:
        outcome = await asyncio.to_thread(pusher.push, job)
        async with control.lock(job.job_hash):
            fresh = await _still(control, job, HUB_PENDING)
            if fresh is None:
                return
            await asyncio.to_thread(jobdir.append_event, fresh.job_dir, HUB_EVENT,
                                    status=JobStatus.COMPLETED.value, hub=outcome.model_dump(mode="json"))
            await asyncio.to_thread(control.registry.update, fresh, hub=outcome, hub_state=HUB_UNPUBLISHED)
    async with control.lock(job.job_hash):
        fresh = await _still(control, job, HUB_UNPUBLISHED)
        if fresh is None:
            return
        fresh = await control.publisher.publish_pending(fresh)
        await asyncio.to_thread(control.registry.update, fresh, hub_state=HUB_DONE)


async def _still(control: JobControl, job: Job, state: str) -> Job | None:
    """The job as it is now, if it still exists in ``state`` (call under its lock)."""
    fresh = await asyncio.to_thread(control.registry.get, job.job_hash)
    return fresh if fresh is not None and fresh.hub_state == state else None
