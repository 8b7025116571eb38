"""Following a training job: its log (ScalarLM's NDJSON-over-event-stream) and its events (SSE).

Both look the job up first, so an unknown job is a 404 with a JSON body, never an empty stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from nats.aio.msg import Msg

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import AdapterEvent, JobEvent, LogLines, LogsRequest
from loopline.gateway.auth.scopes import TRAINING
from loopline.gateway.auth.tenancy import tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.event_streams import SSE_HEADERS, held_stream, of, sse
from loopline.gateway.core.route_spec import EVENT_STREAM, FIELDS, NO_BUS, STREAMS, TRAINER, declare
from loopline.gateway.core.trainer_client import TrainerClient
from loopline.gateway.gateway import gateway_of
from loopline.gateway.scalarlm.statuses import JOB

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/megatron")

# The trainer is asked for new log lines this often while the job runs (ScalarLM's CLI polls at 1 s).
LOG_POLL_S = 1.0
LOG_PAGE = 1000
FINAL_KINDS = {"completed", "failed", "cancelled"}
# Adapter events on a job's stream are named with this prefix (adapter.loaded, adapter.rejected).
ADAPTER_PREFIX = "adapter."
ADAPTER_SUBJECTS = subjects.ADAPTER_EVENTS_ALL.removesuffix(">")  # "events.adapters."
# How long a completed job's stream waits for its newest checkpoint's deployment: a load takes
# under a second on the tiny model and a few on SmolLM2 (docs/tinker/README.md); this covers a
# replica that is busy or restarting, and ends the stream where no replica serves the base model.
DEPLOYMENT_WAIT_S = 30.0


@router.get("/train/logs/{job}", **declare(
    TRAINING, {**JOB, 422: f"{JOB[422]}; {FIELDS}", 429: STREAMS, **TRAINER}, media_type=EVENT_STREAM))
@held_stream
async def train_logs(job: str, request: Request, starting_line_number: int = Query(0, ge=0),
                     follow: bool = True):
    """NDJSON lines ``{"line", "line_number"}`` as ScalarLM's CLI parses them (each chunk as JSON lines,
    so no ``data:`` prefix), served as text/event-stream. Follows the log until the job is over;
    ``follow=false`` returns what is there now."""
    trainer = gateway_of(request).trainer
    first = await trainer.logs(LogsRequest(job=job, owner=tenant_of(request),
                                           starting_line_number=starting_line_number, limit=LOG_PAGE))
    return StreamingResponse(_log_lines(trainer, first, starting_line_number, follow),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _log_lines(trainer: TrainerClient, page: LogLines, next_line: int, follow: bool):
    # Invariant: every line before next_line has been sent once; a page the trainer does not mark as
    # cut short (``more``: at LOG_PAGE lines, or at its LOOPLINE_MAX_LOG_PAGE_BYTES) means we have
    # caught up with the log.
    while True:
        for entry in page.lines:
            # One write per line: the client parses each chunk it receives on its own.
            yield json.dumps({"line": entry.line, "line_number": entry.line_number}) + "\n"
        if page.lines:
            next_line = page.lines[-1].line_number + 1
        caught_up = not page.more
        if caught_up and (page.finished or not follow):
            return
        if caught_up:
            await asyncio.sleep(LOG_POLL_S)
        try:
            page = await trainer.logs(LogsRequest(job=page.job_hash, starting_line_number=next_line,
                                                  limit=LOG_PAGE))
        except ApiError as exc:  # the trainer went away: end; the client asks again from its last line
            log.info("log stream of %s ends early: %s", page.job_hash, exc.message)
            return


@router.get("/train/{job}/events", **declare(TRAINING, {**JOB, 429: STREAMS, **TRAINER},
                                             media_type=EVENT_STREAM))
@held_stream
async def job_events(job: str, request: Request):
    """One job's events, from its first (queued) to its last (completed, failed or cancelled): those
    of its current run. A restarted job's earlier run ended with a final event of its own, which is
    not this run's end, so the stream starts at the run's own ``queued``. Its adapter's events come
    in between, named ``adapter.loaded`` / ``adapter.rejected`` (with the replica's reason), and a
    completed job's stream stays open until its newest checkpoint has one (Deployment)."""
    gateway = gateway_of(request)
    info = await gateway.trainer.get(job, tenant_of(request))
    run_start = await gateway.trainer.current_run_start(info.job_hash)
    sub = await gateway.trainer.follow_events(subjects.job_story(info.job_hash), from_seq=run_start)
    # Only a replica of the job's base model loads or refuses its checkpoints: where no deployment
    # serves it (a stack without inference), waiting for one would only hold the stream open. A
    # deployment counts even when its replicas missed the last census (busy loading, restarting).
    deployment = Deployment(waits=info.llm_name in gateway.models.served)
    return StreamingResponse(sse(sub, story_event, over=info.status.finished, keep=deployment.keep,
                                 ends=lambda event: event.kind in FINAL_KINDS,
                                 then_awaits=deployment.then_awaits, linger_s=DEPLOYMENT_WAIT_S),
                             media_type="text/event-stream", headers=SSE_HEADERS)


def story_event(msg: Msg) -> JobEvent | AdapterEvent:
    """A message of ``subjects.job_story``: a JobEvent, or an adapter event shown as
    ``adapter.loaded`` / ``adapter.rejected`` / ``adapter.retired`` beside the job's own kinds."""
    if msg.subject.startswith(ADAPTER_SUBJECTS):
        event = AdapterEvent.model_validate_json(msg.data)
        return event.model_copy(update={"kind": f"{ADAPTER_PREFIX}{event.kind}"})
    return JobEvent.model_validate_json(msg.data)


class Deployment:
    """What a completed job's stream still waits for: whether a replica serves its newest checkpoint
    (``adapter.loaded`` or ``adapter.rejected`` of that step or a later one), unless that was heard
    already or no deployment serves its base model (``waits``). A failed or cancelled job's stream
    ends with its final event."""

    def __init__(self, waits: bool) -> None:
        self.waits = waits
        self.newest = -1  # the newest checkpoint's step
        self.outcome_step = -1  # the newest step a replica loaded or rejected

    def keep(self, event: JobEvent | AdapterEvent) -> bool:
        if isinstance(event, JobEvent) and event.checkpoint is not None:
            self.newest = max(self.newest, event.checkpoint.step)
        elif self.is_outcome(event):
            self.outcome_step = max(self.outcome_step, event.step or 0)
        return True

    @staticmethod
    def is_outcome(event: JobEvent | AdapterEvent) -> bool:
        return event.kind in (f"{ADAPTER_PREFIX}loaded", f"{ADAPTER_PREFIX}rejected")

    def then_awaits(self, final: JobEvent | AdapterEvent) -> Callable[[JobEvent | AdapterEvent], bool] | None:
        if not self.waits or final.kind != "completed" or self.newest < 0 or self.outcome_step >= self.newest:
            return None
        newest = self.newest
        return lambda event: self.is_outcome(event) and (event.step or 0) >= newest


@router.get("/events", **declare(TRAINING, {429: STREAMS, 503: NO_BUS}, media_type=EVENT_STREAM))
@held_stream
async def all_job_events(request: Request):
    """Every job's events (the key's own jobs': auth/tenancy.py), stored ones first, then live; the
    stream does not end by itself."""
    trainer = gateway_of(request).trainer
    tenant = tenant_of(request)
    sub = await trainer.follow_events(subjects.JOB_EVENTS_ALL)
    keep = _always if tenant is None else OwnJobs(trainer, tenant).owns
    return StreamingResponse(sse(sub, of(JobEvent), over=False, keep=keep),
                             media_type="text/event-stream", headers=SSE_HEADERS)


def _always(_event: JobEvent) -> bool:
    return True


class OwnJobs:
    """Which jobs' events one tenant's stream sends: its own, asked of the trainer once per job
    (a job's owner never changes), so other keys' jobs stay out without a lookup per event."""

    def __init__(self, trainer: TrainerClient, tenant: str):
        self.trainer = trainer
        self.tenant = tenant
        self.known: dict[str, bool] = {}

    async def owns(self, event: JobEvent) -> bool:
        return await self.owns_job(event.job_hash)

    async def owns_job(self, job_hash: str) -> bool:
        owned = self.known.get(job_hash)
        if owned is None:
            try:
                owned = await self.trainer.find(job_hash, self.tenant) is not None
            except ApiError:  # trainer down or slow: leave the event out, ask again at the next
                return False
            self.known[job_hash] = owned
        return owned
