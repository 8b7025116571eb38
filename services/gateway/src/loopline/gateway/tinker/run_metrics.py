"""``POST /v1/tinker/runs/{run}/metrics``: a training run's client reports what it measured at a
step (the cookbook's per-iteration reward, KL, entropy: what its ``metrics.jsonl`` holds), so the
dashboard draws it beside the loss (ui/pages.py). The figures go on EVENTS as the run's worker's
``metrics`` event: durable, in order with its steps, and followed by ``/v1/tinker/runs/{run}/events``.

Bounded like every client-sized thing: ``MAX_METRICS`` names of at most ``MAX_NAME`` characters,
finite numbers only, one step; and ``LOOPLINE_RUN_METRICS_PER_MINUTE`` posts per key (per client
address without keys), since every post is kept on EVENTS and wakes every open dashboard page.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_schemas import SessionEvent
from loopline.gateway.auth.scopes import TRAINING
from loopline.gateway.auth.tenancy import tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.route_spec import declare
from loopline.gateway.gateway import gateway_of
from loopline.gateway.tinker.bodies import parse

router = APIRouter(prefix="/v1/tinker")

MAX_METRICS = 64
MAX_NAME = 128
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME)]
Figure = Annotated[float, Field(allow_inf_nan=False)]


class RunMetricsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int | None = Field(default=None, ge=0, le=2**31 - 1, description=(
        "The optimizer step (or the client's iteration) they were measured at; the run's newest "
        "step when left out."))
    metrics: dict[Name, Figure] = Field(min_length=1, max_length=MAX_METRICS, description=(
        f"Name -> finite number; at most {MAX_METRICS} names of at most {MAX_NAME} characters."))


@router.post("/runs/{run_id}/metrics", **declare(TRAINING, {
    400: f"not JSON, an unknown field, no metrics, more than {MAX_METRICS}, a name over {MAX_NAME} "
         "characters, or a value that is not a finite number (the message names it)",
    404: "no such training run", 409: "the run is not on a session worker yet: retry",
    429: "more posts than `LOOPLINE_RUN_METRICS_PER_MINUTE` from this key (or client address): "
         "retry after `Retry-After`",
    503: "the message bus did not take it: retry"}))
async def post_run_metrics(request: Request, run_id: str) -> dict[str, int]:
    gateway = gateway_of(request)
    gateway.metrics_quota.take(request)  # before the body is read: a refused post costs nothing
    body = await parse(request, RunMetricsBody)
    model = await gateway.tinker.model(run_id, tenant_of(request))
    if not model.worker_id:
        raise ApiError(409, f"training run {run_id} is not on a session worker yet; retry",
                       headers={"Retry-After": "1"})
    event = SessionEvent(worker_id=model.worker_id, kind="metrics", model_id=model.model_id,
                         base_model=model.base_model, step=body.step, metrics=body.metrics)
    try:
        ack = await gateway.js.publish(subjects.session_event(model.worker_id, "metrics"),
                                       event.model_dump_json(exclude_none=True).encode(),
                                       stream=subjects.EVENTS_STREAM)
    except Exception as exc:  # NATS down or slow
        raise ApiError(503, f"could not record the metrics: {exc}; retry",
                       headers={"Retry-After": "2"}) from exc
    return {"seq": ack.seq}
