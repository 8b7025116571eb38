"""ScalarLM-compatible generate routes: the requests and response shapes of ScalarLM's own server, as its
``scalarlm`` client sends and reads them.

Where ScalarLM answers 500 or 200+null for a client mistake, we answer the honest 4xx; where its
client relies on a behaviour (long-poll with null for "not yet", zero-padded ids), we keep it.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import dataclass
from typing import IO, Any

from fastapi import APIRouter, Request, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from loopline.common.config.settings import GatewaySettings
from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import OwnerFilter
from loopline.common.contracts.schemas import (
    BatchManifest,
    ClearQueueReply,
    QueueMetrics,
    ResultItem,
    WorkItem,
)
from loopline.gateway.auth.scopes import ADMIN, INFERENCE
from loopline.gateway.auth.tenancy import owner_of, sees, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import over_limit
from loopline.gateway.core.route_spec import BUS, FIELDS, FULL, MODEL, NOT_JSON, QUEUE, declare
from loopline.gateway.core.submit import (
    Prompt,
    check_max_tokens,
    content_group,
    owned_group,
    request_id,
    split_request_id,
    submit_prompts,
    work_item,
)
from loopline.gateway.gateway import Gateway, gateway_of
from loopline.gateway.scalarlm import upload_entries

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


async def collect(gateway: Gateway, ids: list[str], timeout_s: float, *, stored_first: bool,
                  tenant: OwnerFilter = None) -> list[dict]:
    """Long-poll: wait up to ``timeout_s`` for the results of ``ids``; null for what is not done.
    Another key's batch (auth/tenancy.py) is an unknown one."""
    by_group: dict[str, list[int]] = {}
    for rid in ids:
        group, index = split_request_id(rid)
        by_group.setdefault(group, []).append(index)
    found: dict[str, ResultItem] = {}
    for group, indices in by_group.items():
        if tenant is not None:
            manifest = await gateway.work.manifest(group)
            if manifest is None or not sees(tenant, manifest.owner):
                raise _unknown_ids(group, indices[0])
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
            raise _unknown_ids(group, indices[0])
    return [result_entry(rid, found.get(rid)) for rid in ids]


def _unknown_ids(group: str, index: int) -> ApiError:
    return ApiError(404, f"no request with ids {request_id(group, index)}…: unknown or expired",
                    param="request_ids")


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
    route = await gateway.models.resolve(body.model, tenant_of(request))
    max_tokens = body.max_tokens or settings.default_max_tokens
    key = {"prompts": body.prompts, "model": route.model, "max_tokens": max_tokens,
           "temperature": body.temperature, **tools}
    if route.adapter is not None:
        # Batches are content-addressed; the same prompts after further training are a new batch.
        key["adapter_step"] = route.step
    owner = owner_of(request)
    group = owned_group(content_group(key), owner)
    # Listen before publishing, so a fast answer cannot slip past between the two.
    waiter = await gateway.results.waiter(group)
    try:
        ids, known = await submit_prompts(gateway, route, group, prompts, max_tokens, body.temperature,
                                          kind="generate", skip_if_known=True, tools=tools, owner=owner)
        found = await waiter.wait(list(range(len(ids))), settings.response_timeout_s, stored_first=known)
    finally:
        await waiter.close()
    # Plain JSON already: spare FastAPI's jsonable_encoder walk over hundreds of entries.
    return JSONResponse({"results": [result_entry(rid, found.get(i)) for i, rid in enumerate(ids)]})


@router.post("/get_results", **declare(INFERENCE, {
    400: f"{NOT_JSON}; no request ids; a malformed request id", 404: "no request with these ids",
    413: "more request ids than `LOOPLINE_MAX_IDS_PER_POLL`", 422: FIELDS}))
async def get_results(body: ResultsRequest, request: Request):
    if not body.request_ids:
        raise ApiError(400, "request_ids is empty", param="request_ids")
    limit = request.app.state.settings.max_ids_per_poll
    if len(body.request_ids) > limit:  # each id is waited on, and re-read, for the whole long poll
        raise over_limit(413, f"{len(body.request_ids)} request ids in one poll", limit, "max_ids_per_poll",
                         param="request_ids")
    results = await collect(gateway_of(request), body.request_ids,
                            request.app.state.settings.response_timeout_s, stored_first=True,
                            tenant=tenant_of(request))
    return JSONResponse({"results": results})


@router.post("/upload", **declare(INFERENCE, {
    400: "the file is not a JSON array of requests, or a request is malformed", 404: MODEL,
    413: "the file is larger than `LOOPLINE_MAX_UPLOAD_BYTES`, or one request in it larger than "
         "`LOOPLINE_MAX_BODY_BYTES`", 422: FIELDS, 429: FULL, 503: BUS}))
async def upload(file: UploadFile, request: Request):
    """The file is read as a stream, twice, never whole (scalarlm/upload_entries.py): once for its
    hash (the batch id), once entry by entry, each checked and spooled to disk; then admission,
    then the spooled entries are published a slice at a time."""
    gateway = gateway_of(request)
    settings = request.app.state.settings
    size = await asyncio.to_thread(_size, file.file)
    if size > settings.max_upload_bytes:
        raise over_limit(413, f"the upload is {size} bytes", settings.max_upload_bytes, "max_upload_bytes",
                         param="file")
    owner = owner_of(request)
    group = owned_group(await asyncio.to_thread(upload_entries.file_sha256, file.file), owner)
    if await gateway.work.manifest(group) is not None:
        return {"request_id": group, "error": None}
    with tempfile.TemporaryFile() as spool:
        # One batch may name several models or lengths; each model is routed once.
        models, total = await asyncio.to_thread(_spool_entries, file.file, spool, settings)
        routes = {}
        counts: dict[str, int] = {}
        for model, named in models.items():
            route = await gateway.models.resolve(model, tenant_of(request))
            check_max_tokens(route, named.longest)
            routes[model] = route
            counts[route.deployment] = counts.get(route.deployment, 0) + named.count
        for deployment, count in counts.items():
            gateway.admission.admit(deployment, count)
        first = next(iter(routes.values()))
        manifest = BatchManifest(group=group, total=total, model=first.model, kind="upload", owner=owner)
        spool.seek(0)
        while slice_ := await asyncio.to_thread(_read_slice, spool):
            by_deployment: dict[str, list[WorkItem]] = {}
            for i, model, max_tokens, prompt in slice_:
                route = routes[model]
                item = work_item(route, request_id(group, i), group, i, prompt, max_tokens, 0.0,
                                 kind="upload", total=total)
                by_deployment.setdefault(route.deployment, []).append(item)
            for deployment, items in by_deployment.items():
                await gateway.work.publish(None, items, deployment)
    # The manifest goes last: a batch is "known" only once all its work is durable.
    await gateway.work.publish(manifest, [], first.deployment)
    return {"request_id": group, "error": None}


# Work items published together from the spool: bounds what one upload holds in memory at once.
PUBLISH_SLICE = 512


@dataclass
class _Named:
    """What an upload asks of one model: its longest ``max_tokens`` (checked against the model's
    context once) and how many requests (admitted at once)."""

    longest: int = 0
    count: int = 0


def _size(f: IO[bytes]) -> int:
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    return size


def _spool_entries(f: IO[bytes], spool: IO[bytes],
                   settings: GatewaySettings) -> tuple[dict[str | None, _Named], int]:
    """Check every entry of the upload, writing each as one line of ``spool``; the models named (in
    order of first use), and how many entries there are. In a thread: a large upload would hold
    the event loop for seconds."""
    models: dict[str | None, _Named] = {}
    total = 0
    try:
        for i, entry in enumerate(upload_entries.entries(f, settings.max_body_bytes)):
            if not isinstance(entry, dict):
                raise ApiError(400, f"request {i} must be an object with a prompt")
            prompt = parse_prompt(entry, f"request {i}")
            max_tokens = entry.get("max_tokens") or settings.default_max_tokens
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise ApiError(400, f"request {i}: max_tokens must be a positive integer")
            model = entry.get("model")
            if model is not None and not isinstance(model, str):
                raise ApiError(400, f"request {i}: model must be a string or null")
            named = models.setdefault(model, _Named())
            named.longest, named.count = max(named.longest, max_tokens), named.count + 1
            spool.write(json.dumps([i, model, max_tokens, prompt.text, prompt.messages]).encode() + b"\n")
            total += 1
    except upload_entries.EntryTooLarge as exc:
        raise over_limit(413, str(exc), exc.limit, "max_body_bytes", param="file") from None
    except upload_entries.NotAnArray as exc:
        raise ApiError(400, str(exc), param="file") from None
    if total == 0:
        raise ApiError(400, "the uploaded file must be a non-empty JSON array of requests", param="file")
    return models, total


def _read_slice(spool: IO[bytes]) -> list[tuple[int, str | None, int, Prompt]]:
    entries = []
    for _ in range(PUBLISH_SLICE):
        line = spool.readline()
        if not line:
            break
        i, model, max_tokens, text, messages = json.loads(line)
        entries.append((i, model, max_tokens, Prompt(text=text, messages=messages)))
    return entries


@router.post("/download", **declare(INFERENCE, {
    400: NOT_JSON, 404: "no uploaded batch with this id", 422: FIELDS}))
async def download(body: DownloadRequest, request: Request):
    gateway = gateway_of(request)
    manifest = await gateway.work.manifest(body.request_id)
    if manifest is None or not sees(tenant_of(request), manifest.owner):  # another key's: unknown
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
