"""ScalarLM-compatible generate routes: the requests and response shapes of ScalarLM's own server, as its
``scalarlm`` client sends and reads them.

Where ScalarLM answers 500 or 200+null for a client mistake, we answer the honest 4xx; where its
client relies on a behaviour (long-poll with null for "not yet", zero-padded ids), we keep it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import APIRouter, Request, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import (
    BatchManifest,
    ClearQueueReply,
    QueueMetrics,
    ResultItem,
)
from loopline.gateway.auth.scopes import ADMIN, INFERENCE
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.route_spec import BUS, FIELDS, FULL, MODEL, NOT_JSON, QUEUE, declare
from loopline.gateway.core.submit import (
    Prompt,
    check_max_tokens,
    content_group,
    request_id,
    split_request_id,
    submit_prompts,
    work_item,
)
from loopline.gateway.gateway import Gateway, gateway_of

router = APIRouter(prefix="/v1/generate")


class GenerateRequest(BaseModel):
    prompts: list[Any]
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    tools: Any = None
    tool_choice: Any = None


class ResultsRequest(BaseModel):
    request_ids: list[str]


class DownloadRequest(BaseModel):
    request_id: str


def parse_prompt(entry: Any, where: str) -> Prompt:
    if isinstance(entry, str):
        return Prompt(text=entry)
    if isinstance(entry, dict) and isinstance(entry.get("prompt"), str):
        return Prompt(text=entry["prompt"])
    if isinstance(entry, dict) and isinstance(entry.get("messages"), list) and entry["messages"]:
        return Prompt(messages=entry["messages"])
    raise ApiError(400, f"{where} must be a string, {{\"prompt\": str}} or {{\"messages\": [...]}}",
                   param="prompts")


def result_entry(rid: str, result: ResultItem | None) -> dict:
    if result is None:
        return {"request_id": rid, "response": None, "error": None}
    if result.error is not None:
        return {"request_id": rid, "response": None, "error": result.error.message}
    choice = first_choice(result)
    message = choice.get("message") or {}
    entry = {"request_id": rid, "response": message.get("content") or choice.get("text") or "",
             "error": None, "token_count": result.completion_tokens}
    if message.get("tool_calls"):
        entry["tool_calls"] = message["tool_calls"]  # as ScalarLM's workers report them
    if result.adapter_step is not None:
        # Which checkpoint answered. The scalarlm client reads only request_id/response/error,
        # by key, so extra keys (like token_count) pass through it untouched.
        entry["adapter_step"] = result.adapter_step
    return entry


def first_choice(result: ResultItem) -> dict[str, Any]:
    """The one choice of vLLM's completion or chat completion answer (Prompt.as_request)."""
    choices = json.loads(result.text()).get("choices") or [{}]
    return choices[0]


async def collect(gateway: Gateway, ids: list[str], timeout_s: float, *, stored_first: bool) -> list[dict]:
    """Long-poll: wait up to ``timeout_s`` for the results of ``ids``; null for what is not done."""
    by_group: dict[str, list[int]] = {}
    for rid in ids:
        group, index = split_request_id(rid)
        by_group.setdefault(group, []).append(index)
    found: dict[str, ResultItem] = {}
    for group, indices in by_group.items():
        waiter = await gateway.results.waiter(group)
        try:
            # A batch is known once its manifest is stored, which is before /v1/generate or upload
            # answers with its ids: ids of no known batch get nothing by waiting, so they are not
            # waited for (an unknown id used to be answered 404 only after the whole long poll).
            known = not stored_first or await gateway.work.manifest(group) is not None
            got = await waiter.wait(indices, timeout_s if known else 0.0, stored_first=stored_first)
        finally:
            await waiter.close()
        found.update({request_id(group, i): r for i, r in got.items()})
        if not got and not known:
            raise ApiError(404, f"no request with ids {request_id(group, indices[0])}…: unknown or expired",
                           param="request_ids")
    return [result_entry(rid, found.get(rid)) for rid in ids]


@router.post("", **declare(INFERENCE, {
    400: f"{NOT_JSON}; no prompts; a prompt that is neither text nor messages; tools with text "
         "prompts; max_tokens beyond the model's context",
    404: MODEL, 413: "more prompts than `LOOPLINE_MAX_PROMPTS_PER_REQUEST`: use /v1/generate/upload",
    422: FIELDS, 429: FULL, 503: BUS}))
async def generate(body: GenerateRequest, request: Request):
    gateway = gateway_of(request)
    settings = request.app.state.settings
    if not body.prompts:
        raise ApiError(400, "prompts is empty: send at least one prompt", param="prompts")
    if len(body.prompts) > settings.max_prompts_per_request:
        raise ApiError(413, f"{len(body.prompts)} prompts in one request; the limit is "
                            f"{settings.max_prompts_per_request}: use /v1/generate/upload")
    prompts = [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(body.prompts)]
    tools = {k: v for k, v in (("tools", body.tools), ("tool_choice", body.tool_choice)) if v is not None}
    if tools and any(p.messages is None for p in prompts):
        # vLLM takes tools on chat completions only; dropping them would answer in prose.
        raise ApiError(400, "tools and tool_choice need chat prompts ({\"messages\": [...]}), not text",
                       param="tools")
    route = await gateway.models.resolve(body.model)
    max_tokens = body.max_tokens or settings.default_max_tokens
    key = {"prompts": body.prompts, "model": route.model, "max_tokens": max_tokens,
           "temperature": body.temperature, **tools}
    if route.adapter is not None:
        # Batches are content-addressed; the same prompts after further training are a new batch.
        key["adapter_step"] = route.step
    group = content_group(key)
    # Listen before publishing, so a fast answer cannot slip past between the two.
    waiter = await gateway.results.waiter(group)
    try:
        ids, known = await submit_prompts(gateway, route, group, prompts, max_tokens, body.temperature,
                                          kind="generate", skip_if_known=True, tools=tools)
        found = await waiter.wait(list(range(len(ids))), settings.response_timeout_s, stored_first=known)
    finally:
        await waiter.close()
    # Plain JSON already: spare FastAPI's jsonable_encoder walk over hundreds of entries.
    return JSONResponse({"results": [result_entry(rid, found.get(i)) for i, rid in enumerate(ids)]})


@router.post("/get_results", **declare(INFERENCE, {
    400: f"{NOT_JSON}; no request ids; a malformed request id", 404: "no request with these ids",
    422: FIELDS}))
async def get_results(body: ResultsRequest, request: Request):
    if not body.request_ids:
        raise ApiError(400, "request_ids is empty", param="request_ids")
    results = await collect(gateway_of(request), body.request_ids,
                            request.app.state.settings.response_timeout_s, stored_first=True)
    return JSONResponse({"results": results})


@router.post("/upload", **declare(INFERENCE, {
    400: "the file is not a JSON array of requests, or a request is malformed", 404: MODEL,
    413: "the file is larger than `LOOPLINE_MAX_UPLOAD_BYTES`", 422: FIELDS, 429: FULL, 503: BUS}))
async def upload(file: UploadFile, request: Request):
    gateway = gateway_of(request)
    settings = request.app.state.settings
    data = await file.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise ApiError(413, f"the upload is larger than {settings.max_upload_bytes} bytes")
    try:
        entries = json.loads(data)
    except ValueError as exc:
        raise ApiError(400, f"the uploaded file is not valid JSON: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise ApiError(400, "the uploaded file must be a non-empty JSON array of requests")
    group = hashlib.sha256(data).hexdigest()
    if await gateway.work.manifest(group) is not None:
        return {"request_id": group, "error": None}
    # One batch may name several models or lengths; each run of equal settings is published together.
    runs: dict[tuple[str | None, int], list[tuple[int, Prompt]]] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ApiError(400, f"request {i} must be an object with a prompt")
        prompt = parse_prompt(entry, f"request {i}")
        max_tokens = entry.get("max_tokens") or settings.default_max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError(400, f"request {i}: max_tokens must be a positive integer")
        model = entry.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, f"request {i}: model must be a string or null")
        runs.setdefault((model, max_tokens), []).append((i, prompt))
    plans = []
    for (model, max_tokens), members in runs.items():
        route = await gateway.models.resolve(model)
        check_max_tokens(route, max_tokens)
        plans.append((route, max_tokens, members))
    for route, _, members in plans:
        gateway.admission.admit(route.deployment, len(members))
    manifest = BatchManifest(group=group, total=len(entries), model=plans[0][0].model, kind="upload")
    for n, (route, max_tokens, members) in enumerate(plans):
        items = [work_item(route, request_id(group, i), group, i, p, max_tokens, 0.0, kind="upload",
                           total=len(entries))
                 for i, p in members]
        # The manifest goes last: a batch is "known" only once all its work is durable.
        await gateway.work.publish(manifest if n == len(plans) - 1 else None, items, route.deployment)
    return {"request_id": group, "error": None}


@router.post("/download", **declare(INFERENCE, {
    400: NOT_JSON, 404: "no uploaded batch with this id", 422: FIELDS}))
async def download(body: DownloadRequest, request: Request):
    gateway = gateway_of(request)
    manifest = await gateway.work.manifest(body.request_id)
    if manifest is None:
        raise ApiError(404, f"no uploaded batch {body.request_id!r}: unknown or expired", param="request_id")
    waiter = await gateway.results.waiter(manifest.group)
    try:
        found = await waiter.wait(list(range(manifest.total)), request.app.state.settings.response_timeout_s,
                                  stored_first=True)
    finally:
        await waiter.close()
    results = {}
    for i, result in sorted(found.items()):
        entry = result_entry(request_id(manifest.group, i), result)
        entry["is_acked"] = True
        results[entry.pop("request_id")] = entry
    # current_index < total_requests tells ScalarLM's client to ask again.
    return JSONResponse({"results": results, "current_index": len(found), "total_requests": manifest.total,
                         "work_queue_id": manifest.group})


# Operational: the queue's depth of every deployment, and emptying it for everyone.
@router.get("/metrics", **declare(ADMIN, QUEUE))
async def metrics(request: Request):
    metrics = await gateway_of(request).services.ask_queue(subjects.SVC_QUEUE_METRICS, QueueMetrics)
    return metrics.model_dump(by_alias=True)


@router.post("/clear_queue", **declare(ADMIN, QUEUE))
async def clear_queue(request: Request):
    # A clear cancels every waiting prompt: longer than a query.
    services = gateway_of(request).services
    reply = await services.ask_queue(subjects.SVC_QUEUE_CLEAR, ClearQueueReply, timeout_s=30)
    return reply.model_dump()
