"""Following the Tinker API's training sessions: the session workers' events as server-sent events
(``events.sessions.<worker>.<kind>`` on EVENTS: a model created, a step with its loss, weights
saved, a model or the worker released, the worker failed).

    /v1/tinker/events                  every worker's, from now on (or the stored history first)
    /v1/tinker/workers/{worker}/events one worker's, from its start to its end
    /v1/tinker/runs/{run}/events       one training run's (a training client's model), to its end

Each message's ``id`` is its EVENTS sequence: a client whose connection was cut asks again with
``after=<the last id it got>`` and misses nothing, sees nothing twice. A worker or run that does
not exist is a 404 with a JSON body, never an empty stream.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import OwnerFilter
from loopline.common.contracts.tinker_schemas import SessionEvent, TinkerModel, TinkerWorker
from loopline.gateway.auth.scopes import TRAINING
from loopline.gateway.auth.tenancy import sees, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.event_streams import SSE_HEADERS, held_stream, of, sse
from loopline.gateway.core.route_spec import EVENT_STREAM, FIELDS, NO_BUS, STREAMS, declare
from loopline.gateway.gateway import Gateway, gateway_of

router = APIRouter(prefix="/v1/tinker")

# The kinds that end a worker (with no model named) or one of its models (naming it).
END_KINDS = {"released", "failed"}
# A worker id becomes a subject token: nothing NATS reads as a separator or a wildcard.
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RETRY = {"Retry-After": "2"}
AFTER = Query(None, ge=0, le=2**63 - 1, description="resume after this event id (an SSE message's `id`)")


def _worker_ended(event: SessionEvent) -> bool:
    return event.model_id is None and event.kind in END_KINDS


def _start(after: int | None) -> int | None:
    return None if after is None else after + 1


@router.get("/events", **declare(TRAINING, {422: FIELDS, 429: STREAMS, 503: NO_BUS}, media_type=EVENT_STREAM))
@held_stream
async def all_session_events(request: Request, history: bool = False, after: int | None = AFTER):
    """Every session worker's events as they happen; ``history=true`` sends the stored ones first.
    The stream does not end by itself."""
    sub = await gateway_of(request).trainer.follow_events(
        subjects.SESSION_EVENTS_ALL, from_seq=_start(after), new_only=not history and after is None)
    keep = OwnRuns(gateway_of(request), tenant_of(request)).keep
    return StreamingResponse(sse(sub, of(SessionEvent), over=False, keep=keep),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/workers/{worker_id}/events", **declare(TRAINING, {
    404: "no such session worker", 422: FIELDS, 429: STREAMS, 503: NO_BUS}, media_type=EVENT_STREAM))
@held_stream
async def worker_events(request: Request, worker_id: str, after: int | None = AFTER):
    """One session worker's events, from its first to the one that ends it (released, failed); for a
    worker over already, its stored history, then the stream closes."""
    gateway = gateway_of(request)
    worker = await _worker(gateway, worker_id)
    sub = await gateway.trainer.follow_events(subjects.session_event(worker.worker_id, "*"),
                                              from_seq=_start(after))
    over = worker.state in ("released", "failed")
    keep = OwnRuns(gateway, tenant_of(request)).keep
    return StreamingResponse(sse(sub, of(SessionEvent), over=over, keep=keep,
                                 ends=_worker_ended),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/runs/{run_id}/events", **declare(TRAINING, {
    404: "no such training run", 409: "the run is not on a session worker yet: retry", 422: FIELDS,
    429: STREAMS, 503: NO_BUS}, media_type=EVENT_STREAM))
@held_stream
async def run_events(request: Request, run_id: str, after: int | None = AFTER):
    """One training run's events (``run_id`` is the training client's model id), and its worker's
    end; the stream ends when the run is released or fails, or its worker ends."""
    gateway = gateway_of(request)
    model = await _model(gateway, run_id)
    if not sees(tenant_of(request), model.owner):  # another key's run: as if there were none
        raise ApiError(404, f"no training run {run_id!r} on this server", param="run_id")
    if not model.worker_id:
        raise ApiError(409, f"training run {run_id} is not on a session worker yet; retry",
                       headers={"Retry-After": "1"})

    def of_run(event: SessionEvent) -> bool:
        return event.model_id in (None, model.model_id)

    def ends(event: SessionEvent) -> bool:
        return _worker_ended(event) or (event.model_id == model.model_id and event.kind in END_KINDS)

    sub = await gateway.trainer.follow_events(subjects.session_event(model.worker_id, "*"),
                                              from_seq=_start(after))
    return StreamingResponse(sse(sub, of(SessionEvent), over=model.state != "active",
                                 keep=of_run, ends=ends),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _worker(gateway: Gateway, worker_id: str) -> TinkerWorker:
    if not _SUBJECT_TOKEN.match(worker_id):
        raise ApiError(404, f"no session worker {worker_id!r}: a worker id is letters, digits, - and _",
                       param="worker_id")
    try:
        worker = await gateway.tinker.store.worker(worker_id)
    except Exception as exc:  # NATS down or slow
        raise ApiError(503, f"cannot read the session workers: {exc}; retry", headers=RETRY) from exc
    if worker is None:
        raise ApiError(404, f"no session worker {worker_id!r}", param="worker_id")
    return worker


async def _model(gateway: Gateway, run_id: str) -> TinkerModel:
    try:
        model = await gateway.tinker.store.model(run_id)
    except Exception as exc:  # NATS down or slow
        raise ApiError(503, f"cannot read the training runs: {exc}; retry", headers=RETRY) from exc
    if model is None:
        raise ApiError(404, f"no training run {run_id!r} on this server", param="run_id")
    return model


class OwnRuns:
    """Which of a worker's events one tenant's stream sends (auth/tenancy.py): the worker's own
    (starting, ready, released: no run named) and its own runs'; a worker serves every key's runs
    on its base model. Each run's owner is read once."""

    def __init__(self, gateway: Gateway, tenant: OwnerFilter):
        self.gateway = gateway
        self.tenant = tenant
        self.known: dict[str, bool] = {}

    async def keep(self, event: SessionEvent) -> bool:
        return await self.sees_run(event.model_id)

    async def sees_run(self, model_id: str | None) -> bool:
        """Whether the tenant sees an event of run ``model_id`` (None: the worker's own event)."""
        if self.tenant is None or model_id is None:
            return True
        seen = self.known.get(model_id)
        if seen is None:
            try:
                model = await self.gateway.tinker.store.model(model_id)
            except Exception:  # noqa: BLE001 - NATS slow: leave the event out, ask at the next
                return False
            seen = self.known[model_id] = model is not None and sees(self.tenant, model.owner)
        return seen
