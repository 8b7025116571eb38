"""vLLM's OpenAI-compatible routes, through the queue: /v1/chat/completions, /v1/completions,
/v1/responses, /v1/embeddings and the other pooling routes, /tokenize, /detokenize; and /v1/models.

The gateway does not re-implement vLLM's API. It reads two fields of the body (``model``, to route
the request to a deployment or a job's adapter, and ``stream``), makes the request durable on the
deployment's WORK subject, and answers with what the replica's vLLM server answered: the status and
body as they came, or the stream's events as they are made. What is ours: routing and admission
(429), the JetStream ack before anything is answered, adapters by job hash or ``latest``, and the
version stamp of an adapter answer (``system_fingerprint``: ``<job hash>@<step>``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from nats.aio.subscription import Subscription

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import QUEUED_ROUTES, ResultItem, WorkItem
from loopline.gateway.auth.scopes import INFERENCE
from loopline.gateway.auth.tenancy import owner_of, tenant_of
from loopline.gateway.core.answers import Answers
from loopline.gateway.core.arrivals import Arrivals
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import check_count
from loopline.gateway.core.openapi_docs import route_docs
from loopline.gateway.core.recent_requests import ANSWERS, Answer
from loopline.gateway.core.results import Results
from loopline.gateway.core.route_spec import declare
from loopline.gateway.core.submit import fresh_group, request_id
from loopline.gateway.gateway import gateway_of

router = APIRouter()

# An OpenAI request waits for its answer on the connection; this bounds a wait nobody ends.
ANSWER_TIMEOUT_S = 600.0
KEEPALIVE_S = 15.0
SSE = "text/event-stream; charset=utf-8"


@router.get("/v1/models", **declare(INFERENCE))
async def list_models(request: Request):
    """The served models (those a replica answers for now), then their deployed adapters (as vLLM
    lists LoRA modules: ``parent`` is the base model, and the id is what to put in ``model``: the
    job hash): the key's own (auth/tenancy.py)."""
    gateway = gateway_of(request)
    served = {info.model: info for info in await gateway.models.refresh_listing()}
    data: list[dict[str, Any]] = [
        {"id": info.model, "object": "model", "created": int(info.created_at), "owned_by": "loopline",
         "root": info.model, "parent": None, "max_model_len": info.max_model_len, "engine": info.engine,
         "tasks": info.tasks}
        for info in served.values()
    ]
    for adapter in await gateway.models.visible_adapters(tenant_of(request)):
        base = served.get(adapter.base_model)
        if base is not None:
            data.append({"id": adapter.job_hash, "object": "model", "created": int(adapter.first_loaded_at),
                         "owned_by": "loopline", "root": adapter.job_hash, "parent": base.model,
                         "max_model_len": base.max_model_len, "engine": base.engine,
                         "adapter_type": adapter.adapter_type, "step": adapter.step})
    return {"object": "list", "data": data}


async def relay(request: Request):
    """Any of vLLM's queued routes: route the body, queue it, answer with vLLM's answer."""
    gateway = gateway_of(request)
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except ValueError:
        body = None  # not JSON: the default deployment's vLLM answers it, in its own words
    if not isinstance(body, dict):
        body = {}
    for count in ("n", "best_of"):  # each sample is held whole on its way back through the gateway
        check_count(body.get(count), gateway.settings.max_samples_per_request, "max_samples_per_request",
                    count)
    model = body.get("model")
    route = await gateway.models.resolve(model if isinstance(model, str) else None, tenant_of(request))
    if isinstance(model, str) and route.adapter is None and model != route.info.model:
        # The default model's other name: vLLM knows the deployment by its served name only.
        body["model"] = route.info.model
        text = json.dumps(body)  # ASCII escapes: a lone surrogate survives for vLLM to refuse
    stream = body.get("stream") is True
    gateway.admission.admit(route.deployment, 1)
    group = fresh_group()
    rid = request_id(group, 0)
    events = _Events(gateway.answers, gateway.results, group, rid)
    await events.open(stream=stream)
    try:
        item = WorkItem(request_id=rid, group=group, index=0, model=route.model, route=request.url.path,
                        body=text, adapter=route.adapter, reply_to=events.reply_to, stream=stream,
                        kind="openai", batch_total=1)
        await gateway.work.publish(None, [item], route.deployment)
        first = await events.next(ANSWER_TIMEOUT_S)
        if first is None:
            raise ApiError(504, "no inference replica answered in time; the request is still queued "
                                "— retry later")
    except BaseException:
        await events.close()
        raise
    if isinstance(first, ResultItem) and not first.streamed:
        await events.close()
        ANSWERS.add(Answer(time.time(), request.url.path, str(model or route.model), route.adapter,
                           first.adapter_step, first.replica, first.status, owner_of(request)))
        # A Response, not a dict: the body is vLLM's JSON text already.
        return Response(first.text(), status_code=first.status, media_type=first.media_type)
    return StreamingResponse(_relay_stream(events, first), media_type=SSE,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


for _path in QUEUED_ROUTES:
    router.add_api_route(_path, relay, methods=["POST"], **route_docs(_path))


async def _relay_stream(events: _Events, first: tuple[int, bytes] | ResultItem) -> AsyncIterator[bytes]:
    """The stream's events in order, each once. The result's transcript is the authority: events
    lost in a NATS reconnect are sent from it, and events of a redelivered request served again
    from the start are skipped up to where the client already is."""
    sent = 0
    event: tuple[int, bytes] | ResultItem | None = first
    idle = 0.0
    finished = False
    try:
        # Invariant: the client has exactly events 0..sent-1 of the answer.
        while True:
            if isinstance(event, tuple):
                seq, data = event
                if seq == sent:
                    yield data
                    sent += 1
            elif isinstance(event, ResultItem):
                if event.streamed:
                    for stored in event.events()[sent:]:
                        yield stored.encode()
                else:  # failed after the stream began (dead-lettered, cancelled)
                    yield b"data: %s\n\ndata: [DONE]\n\n" % event.text().encode()
                finished = True
                return
            else:
                idle += KEEPALIVE_S
                if idle > ANSWER_TIMEOUT_S:
                    err = {"error": {"message": "no inference replica answered in time", "code": 504}}
                    yield b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(err).encode()
                    return
                yield b": keep-alive\n\n"
            event = await events.next(KEEPALIVE_S)
            if event is not None:
                idle = 0.0
    finally:
        if not finished:  # the client went away (or we gave up): vLLM need not go on generating
            await events.cancel()
        await events.close()


class _Events:
    """A request's stream events and then its result, each once."""

    def __init__(self, answers: Answers, results: Results, group: str, rid: str):
        self.answers = answers  # where the result arrives
        self.stored = results  # where a result missed in a reconnect is found, and the streams
        self.group, self.rid = group, rid
        self.stream_events: deque[tuple[int, bytes]] = deque()
        # The result (index 0 of its group): heard through answers, or found in RESULTS.
        self.result: Arrivals[int, ResultItem] = Arrivals(lambda index: results.lookup(group, index))
        self.result_given = False
        self.sub: Subscription | None = None
        self.reply_to: str | None = None  # set by open()

    async def open(self, *, stream: bool) -> None:
        """Listen before the work is published, so that no answer can arrive unheard."""
        self.reply_to = self.answers.expect(self.group, lambda result: self.result.heard(0, result))
        if stream:
            self.sub = await self.stored.follow_stream(self.rid, self._on_event)

    def _on_event(self, event: tuple[int, bytes]) -> None:
        self.stream_events.append(event)
        self.result.wake()

    async def next(self, timeout_s: float) -> tuple[int, bytes] | ResultItem | None:
        """The next event, stream events before the result; ``None`` means nothing came for
        ``timeout_s`` (a keep-alive is due), or the result has been given already."""
        if not self.stream_events and not self.result_given:
            # Nothing is stored yet when the request has just been published: listen first.
            await self.result.wait([0], timeout_s, stored_first=False, until=lambda: bool(self.stream_events))
        if self.stream_events:
            return self.stream_events.popleft()
        if 0 in self.result.found and not self.result_given:
            self.result_given = True
            return self.result.found[0]
        return None

    async def cancel(self) -> None:
        try:
            await self.stored.nc.publish(subjects.cancel(self.rid), b"")
        except Exception:  # noqa: BLE001 - NATS down: the generation runs to its end, nothing lost
            pass

    async def close(self) -> None:
        self.answers.forget(self.group)
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing
                pass
            self.sub = None
