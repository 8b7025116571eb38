"""The Tinker API's sampling (``asample``, and ``compute_logprobs``, which is an ``asample``),
through the serving path: the request becomes vLLM's ``/v1/completions`` request with token ids in
(sampling.py), queued like any OpenAI request (admission, durability, version pinning), and
its answer becomes the SDK's protobuf SampleResponse when the future is retrieved.

A sampling session names the weights: a sampler checkpoint's adapter hash (each save is one,
pinned: a client made from an earlier save keeps sampling exactly those weights) or the base model.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from nats.js.errors import NotFoundError
from tinker import types as tt

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.sampler_version import SamplerVersion
from loopline.common.contracts.schemas import ResultItem, WorkItem
from loopline.common.contracts.tinker_schemas import FutureResult, Payload, TinkerSampler
from loopline.common.runtime import bus
from loopline.gateway.auth.scopes import INFERENCE
from loopline.gateway.auth.tenancy import owner_of, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import check_count
from loopline.gateway.core.results import ResultWaiter
from loopline.gateway.core.route_spec import BUS, FULL, declare
from loopline.gateway.core.submit import fresh_group, request_id, split_request_id
from loopline.gateway.gateway import Gateway, gateway_of
from loopline.gateway.tinker import stability
from loopline.gateway.tinker.bodies import parse
from loopline.gateway.tinker.sampling import (
    TinkerUserError,
    completion_body,
    prefix_bodies,
    prefix_count,
    sample_response,
)
from loopline.gateway.tinker.statuses import BODY, QUOTA

router = APIRouter(prefix="/api/v1")

PROTO = "application/x-protobuf"


async def _sampler_of(gateway: Gateway, path: str | None, base_model: str | None,
                      sampling_session_id: str, request: Request,
                      session_id: str | None = None) -> TinkerSampler:
    """A sampling session for a tinker path (its sampler checkpoint: the key's own, auth/tenancy.py)
    or a base model."""
    tinker = gateway.tinker
    if path is not None:
        try:
            parsed = tinker_names.parse_path(path)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="model_path") from None
        if parsed.kind != "sampler_weights":
            raise ApiError(400, f"{path} holds training state; sample from a sampler_weights path "
                                "(save_weights_for_sampler)", param="model_path")
        checkpoint = await tinker.checkpoint(parsed.model_id, parsed.kind, parsed.name, tenant_of(request))
        if checkpoint is None or checkpoint.adapter is None:
            raise ApiError(404, f"no sampler checkpoint {path}", param="model_path")
        model = await tinker.model(parsed.model_id)
        return TinkerSampler(sampling_session_id=sampling_session_id, base_model=model.base_model,
                             adapter=checkpoint.adapter, model_path=path, step=checkpoint.step,
                             owner=owner_of(request), session_id=session_id)
    if base_model is None:
        raise ApiError(400, "name a model_path or a base_model to sample from", param="base_model")
    info = await tinker.base(base_model)
    return TinkerSampler(sampling_session_id=sampling_session_id, base_model=info.model,
                         owner=owner_of(request), session_id=session_id)


@router.post("/create_sampling_session", **declare(INFERENCE, {
    400: f"{BODY}; not a sampler_weights path", 404: "no such checkpoint or base model", 429: QUOTA}))
async def create_sampling_session(request: Request) -> dict[str, Any]:
    body = await parse(request, tt.CreateSamplingSessionRequest)
    gateway = gateway_of(request)
    sampler = await _sampler_of(gateway, body.model_path, body.base_model, tinker_names.new_id(), request,
                                body.session_id)
    gateway.session_quota.take(request)  # after the checks: a refused request creates nothing
    await gateway.tinker.store.put_sampler(sampler)
    return {"sampling_session_id": sampler.sampling_session_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}", **declare(INFERENCE, {404: "no such sampling session"}))
async def get_sampler(request: Request, sampler_id: str) -> dict[str, Any]:
    sampler = await gateway_of(request).tinker.sampler(sampler_id, tenant_of(request))
    if sampler is None:
        raise ApiError(404, f"no sampling session {sampler_id!r}", param="sampler_id")
    return {"sampler_id": sampler.sampling_session_id, "base_model": sampler.base_model,
            "model_path": sampler.model_path}


@router.post("/asample", **declare(INFERENCE, {
    400: f"{BODY}; a sampling option this server cannot honour (the message names it); more "
         "`num_samples` than `LOOPLINE_MAX_SAMPLES_PER_REQUEST`",
    404: "no such sampling session, checkpoint or base model", 429: FULL, 503: BUS}))
async def asample(request: Request) -> dict[str, Any]:
    raw = await request.body()
    body = await parse(request, tt.SampleRequest)
    gateway = gateway_of(request)
    # Before anything is made for it: the reply alone lists one id per sample (10**9 of them once
    # grew the gateway to 22 GB), and the answer holds every sample.
    check_count(body.num_samples, gateway.settings.max_samples_per_request, "max_samples_per_request",
                "num_samples")
    if body.sampling_session_id is not None:
        found = await gateway.tinker.sampler(body.sampling_session_id, tenant_of(request))
        if found is None:
            raise ApiError(404, f"no sampling session {body.sampling_session_id!r}",
                           param="sampling_session_id")
        sampler = found
        if time.time() - sampler.written > gateway.settings.tinker_sessions_max_age_s / 2:
            # In use: written again, so that its bucket's TTL takes only abandoned ones.
            sampler.written_at = time.time()
            await gateway.tinker.store.put_sampler(sampler)
    else:
        sampler = await _sampler_of(gateway, body.model_path, body.base_model, "", request)
    route = await gateway.models.resolve(sampler.base_model)
    try:
        vllm_body = completion_body(body, sampler.adapter or route.info.model)
        # target_prompt_logprobs and prompt_alt_tokens_k: one more vLLM request each, items 1.. of
        # the group (prompt_scoring.py says why), answered together with item 0.
        bodies = [vllm_body, *prefix_bodies(body, sampler.adapter or route.info.model)]
    except TinkerUserError as exc:
        raise ApiError(400, str(exc)) from None
    gateway.admission.admit(route.deployment, len(bodies))  # 429: the SDK backs off and sends it again
    group = fresh_group()
    rid = request_id(group, 0)
    items = [WorkItem(request_id=request_id(group, i), group=group, index=i,
                      model=sampler.adapter or route.info.model, route="/v1/completions", body=json.dumps(b),
                      adapter=sampler.adapter, kind="openai", batch_total=len(bodies))
             for i, b in enumerate(bodies)]
    # What the answer is turned into needs the request, kept beside the future: both are stored
    # before the reply, at once (in sequence they cost the client a round trip more). The request
    # carries the version of the weights it samples, for the trainer's staleness count.
    version = _version_of(sampler)
    await asyncio.gather(
        bus.publish_durable(gateway.js, subjects.tinker_sample_request(rid), raw, msg_id=f"{rid}.request",
                            headers=version.headers() if version else None, deadline_s=30),
        gateway.work.publish(None, items, route.deployment))
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(body.num_samples)]}


def _version_of(sampler: TinkerSampler) -> SamplerVersion | None:
    """The training run and step of a sampler's saved weights; None for the base model."""
    if sampler.model_path is None or sampler.step is None:
        return None
    return SamplerVersion(tinker_names.parse_path(sampler.model_path).model_id, sampler.step)


async def wait_sample(gateway: Gateway, rid: str, timeout_s: float) -> FutureResult | None:
    """A sample future's result, as the SDK wants it, or None if vLLM has not answered yet."""
    try:
        group, index = split_request_id(rid)
    except ApiError:
        raise ApiError(404, f"no future {rid!r} on this server", param="request_id") from None
    deadline = time.monotonic() + timeout_s
    waiter = await gateway.results.waiter(group)
    try:
        found = await waiter.wait([index], timeout_s, stored_first=True)
        result = found.get(index)
        return None if result is None else await _sample_result(gateway, rid, result, waiter, deadline)
    finally:
        await waiter.close()


async def _prefix_answers(waiter: ResultWaiter, rid: str, count: int,
                          deadline: float) -> list[dict[str, Any]] | FutureResult | None:
    """The answers to the request's prompt-prefix requests (items 1..count of its group): None if
    not all are in yet, a failed FutureResult if vLLM refused one."""
    keys = list(range(1, count + 1))
    found = await waiter.wait(keys, max(0.0, deadline - time.monotonic()), stored_first=True)
    if not set(keys) <= set(found):
        return None
    for key in keys:
        if found[key].status != 200:
            status = found[key].status
            return FutureResult(request_id=rid, ok=False, category="user" if status < 500 else "server",
                                error=f"scoring the prompt failed ({status}): {found[key].text()}")
    return [json.loads(found[key].text()) for key in keys]


async def _sample_result(gateway: Gateway, rid: str, result: ResultItem, waiter: ResultWaiter,
                         deadline: float) -> FutureResult | None:
    if result.status != 200:
        # vLLM refused the request (a user error), or it could not be served (dead-lettered).
        return FutureResult(request_id=rid, ok=False, category="user" if result.status < 500 else "server",
                            error=f"sampling failed ({result.status}): {result.text()}")
    try:
        stored = await gateway.js.get_last_msg(subjects.TINKER_FUTURES_STREAM,
                                               subjects.tinker_sample_request(rid), direct=True)
    except NotFoundError:
        return FutureResult(request_id=rid, ok=False, category="server",
                            error="the sample request expired before it was retrieved")
    request = tt.SampleRequest.model_validate_json(stored.data or b"{}")
    prefixes: list[dict[str, Any]] = []
    if prefix_count(request):
        answers = await _prefix_answers(waiter, rid, prefix_count(request), deadline)
        if not isinstance(answers, list):
            return answers
        prefixes = answers
    try:
        proto = sample_response(json.loads(result.text()), request, prefixes)
    except ValueError as exc:  # vLLM answered something else than was asked (an abort, say)
        return FutureResult(request_id=rid, ok=False, category="server", error=f"sampling failed: {exc}")
    if request.record_stability_info:
        await stability.keep(gateway, rid, request, proto)
    return FutureResult(request_id=rid, media_type=PROTO, payload=Payload.inline(proto))
