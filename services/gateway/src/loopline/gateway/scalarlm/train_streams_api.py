"""Following a training job: its log (ScalarLM's NDJSON-over-event-stream) and its events (SSE).

Both look the job up first, so an unknown job is a 404 with a JSON body, never an empty stream.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import JobEvent, LogLines, LogsRequest
from loopline.gateway.auth.scopes import TRAINING
from loopline.gateway.auth.tenancy import tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.event_streams import SSE_HEADERS, held_stream, sse
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
    # Invariant: every line before next_line has been sent once; a page shorter than LOG_PAGE means
    # we have caught up with the log.
    while True:
        for entry in page.lines:
            # One write per line: the client parses each chunk it receives on its own.
            yield json.dumps({"line": entry.line, "line_number": entry.line_number}) + "\n"
        if page.lines:
            next_line = page.lines[-1].line_number + 1
        caught_up = len(page.lines) < LOG_PAGE
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
    not this run's end, so the stream starts at the run's own ``queued``."""
    trainer = gateway_of(request).trainer
    info = await trainer.get(job, tenant_of(request))
    run_start = await trainer.current_run_start(info.job_hash)
    sub = await trainer.follow_events(subjects.job_events(info.job_hash), from_seq=run_start)
    return StreamingResponse(sse(sub, JobEvent.model_validate_json, over=info.status.finished,
                                 ends=lambda event: event.kind in FINAL_KINDS),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/events", **declare(TRAINING, {429: STREAMS, 503: NO_BUS}, media_type=EVENT_STREAM))
@held_stream
async def all_job_events(request: Request):
    """Every job's events (the key's own jobs': auth/tenancy.py), stored ones first, then live; the
    stream does not end by itself."""
    trainer = gateway_of(request).trainer
    tenant = tenant_of(request)
    sub = await trainer.follow_events(subjects.JOB_EVENTS_ALL)
    keep = _always if tenant is None else OwnJobs(trainer, tenant).owns
    return StreamingResponse(sse(sub, JobEvent.model_validate_json, over=False, keep=keep),
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
        owned = self.known.get(event.job_hash)
        if owned is None:
            try:
                owned = await self.trainer.find(event.job_hash, self.tenant) is not None
            except ApiError:  # trainer down or slow: leave the event out, ask again at the next
                return False
            self.known[event.job_hash] = owned
        return owned
