"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE or JSON)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from nats.aio.subscription import Subscription

from loopline.common.schemas import ResultItem, SamplingParams, TokenDelta
from loopline.gateway.answers import Answers
from loopline.gateway.errors import ApiError
from loopline.gateway.gateway import gateway_of
from loopline.gateway.openai_models import ChatCompletionRequest, CommonParams, CompletionRequest
from loopline.gateway.results import Results
from loopline.gateway.submit import Prompt, fresh_group, request_id, submit_prompts

router = APIRouter(prefix="/v1")

# An OpenAI request waits for its answer on the connection; this bounds a wait nobody ends.
ANSWER_TIMEOUT_S = 600.0
KEEPALIVE_S = 15.0


@router.get("/models")
async def list_models(request: Request):
    """The served models, then the deployed adapters (as vLLM lists LoRA modules: ``parent`` is
    the base model, and the id is what to put in ``model``: the job hash)."""
    gateway = gateway_of(request)
    await gateway.models.refresh()
    served = gateway.models.served
    data = [
        {"id": info.model, "object": "model", "created": int(info.created_at), "owned_by": "loopline",
         "root": info.model, "parent": None, "max_model_len": info.max_model_len, "engine": info.engine}
        for info in served.values()
    ]
    for adapter in sorted(gateway.adapters.served.values(), key=lambda a: a.first_loaded_at):
        base = served.get(adapter.base_model)
        if base is not None:
            data.append({"id": adapter.job_hash, "object": "model", "created": int(adapter.first_loaded_at),
                         "owned_by": "loopline", "root": adapter.job_hash, "parent": base.model,
                         "max_model_len": base.max_model_len, "engine": base.engine,
                         "adapter_type": adapter.adapter_type, "step": adapter.step})
    return {"object": "list", "data": data}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    if body.echo or body.logprobs:
        raise ApiError(400, "echo and logprobs are not supported by this server", param="echo")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ApiError(400, "prompt is empty", param="prompt")
    return await _serve(request, body, [Prompt(text=p) for p in prompts], chat=False)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    return await _serve(request, body, [Prompt(messages=body.messages_as_dicts())], chat=True)


async def _serve(request: Request, body: CommonParams, prompts: list[Prompt], *, chat: bool):
    gateway = gateway_of(request)
    route = await gateway.models.resolve(body.model)
    sampling = SamplingParams(
        max_tokens=body.max_tokens or request.app.state.settings.default_max_tokens,
        temperature=body.temperature, top_p=body.top_p, stop=body.stop_list(), seed=body.seed, n=body.n,
    )
    group = fresh_group()
    shape = _Shape(chat=chat, model=route.model, id=("chatcmpl-" if chat else "cmpl-") + group,
                   n=body.n, adapter=route.adapter)
    events = _Events(gateway.answers, gateway.results, group, len(prompts))
    await events.open(stream=body.stream)
    try:
        ids, _ = await submit_prompts(gateway, route, group, prompts, sampling, kind="openai",
                                      stream=body.stream, reply_to=events.reply_to)
        if not body.stream:
            results = await events.all_results(ANSWER_TIMEOUT_S)
            # A Response, not a dict: FastAPI would first walk the plain JSON through
            # jsonable_encoder, a few percent of the gateway's CPU per request for nothing.
            return JSONResponse(shape.response(results))
        first = await events.next(ANSWER_TIMEOUT_S)
    except BaseException:
        await events.close()
        raise
    if isinstance(first, ResultItem) and first.error is not None:
        await events.close()
        raise ApiError(first.error.status, first.error.message, type=first.error.type)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = shape.sse(events, first, ids, include_usage)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Events:
    """Token deltas and results of one OpenAI request, in arrival order."""

    def __init__(self, answers: Answers, results: Results, group: str, count: int):
        self.answers = answers  # where the results arrive
        self.stored = results  # where a result missed in a reconnect is found, and the token streams
        self.group, self.count = group, count
        self.queue: asyncio.Queue = asyncio.Queue()
        self.results: dict[int, ResultItem] = {}
        self.subs: list[Subscription] = []
        self.reply_to: str | None = None  # set by open()

    async def open(self, *, stream: bool) -> None:
        """Listen before the work is published, so that no answer can arrive unheard."""
        self.reply_to = self.answers.expect(self.group, self._on_result)
        if stream:
            for i in range(self.count):
                self.subs.append(await self.stored.follow_tokens(request_id(self.group, i),
                                                                 self.queue.put_nowait))

    def _on_result(self, result: ResultItem) -> None:
        if result.index not in self.results:
            self.results[result.index] = result
            self.queue.put_nowait(result)

    async def next(self, timeout_s: float) -> TokenDelta | ResultItem | None:
        """The next event; ``None`` means nothing came for a while (a keep-alive is due)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=min(1.0, deadline - time.monotonic()))
            except TimeoutError:
                # A NATS reconnect drops core messages: look the missing results up in the stream.
                for i in range(self.count):
                    if i not in self.results:
                        found = await self.stored.lookup(self.group, i)
                        if found is not None:
                            self._on_result(found)
                            return self.queue.get_nowait()
                if time.monotonic() >= deadline:
                    raise ApiError(504, "no inference replica answered in time; the request is still "
                                        "queued — retry later") from None

    async def all_results(self, timeout_s: float) -> list[ResultItem]:
        try:
            while len(self.results) < self.count:
                await self.next(timeout_s)
        finally:
            await self.close()
        return [self.results[i] for i in range(self.count)]

    async def close(self) -> None:
        self.answers.forget(self.group)
        for sub in self.subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing
                pass
        self.subs = []


class _Shape:
    """Builds OpenAI's response objects for completions and chat.

    For an adapter request, ``system_fingerprint`` (OpenAI's "which backend configuration produced
    this") is ``<job hash>@<step>``: the checkpoint the replica pinned for the whole generation, so
    a client can tell which version answered while new checkpoints keep arriving. The base model
    has none (the key is left out, as OpenAI allows).
    """

    def __init__(self, *, chat: bool, model: str, id: str, n: int, adapter: str | None = None):
        self.chat, self.model, self.id, self.n = chat, model, id, n
        self.adapter = adapter  # the job hash actually served (``latest`` resolved)
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _choice(self, index: int, text: str, finish: str | None) -> dict:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def fingerprint(self, step: int | None) -> str | None:
        return f"{self.adapter}@{step}" if self.adapter is not None and step is not None else None

    def fingerprint_of(self, results: list[ResultItem]) -> str | None:
        """One request, one version; a completions request with several prompts is several work
        items, which may be pinned to different versions: then all of them, oldest first."""
        steps = sorted({r.adapter_step for r in results if r.adapter_step is not None})
        return ",".join(fp for s in steps if (fp := self.fingerprint(s)) is not None) or None

    def response(self, results: list[ResultItem]) -> dict:
        for result in results:
            if result.error is not None:
                raise ApiError(result.error.status, result.error.message, type=result.error.type)
        choices = [self._choice(r.index * self.n + c.index, c.text, _finish(c.finish_reason))
                   for r in results for c in r.choices]
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": choices, "usage": _usage(results)}
        if (fingerprint := self.fingerprint_of(results)) is not None:
            obj["system_fingerprint"] = fingerprint
        return obj

    def _chunk(self, choices: list[dict], usage: dict | None = None, fingerprint: str | None = None) -> str:
        obj: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": choices}
        if fingerprint is not None:
            obj["system_fingerprint"] = fingerprint
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _delta(self, index: int, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

    async def sse(self, events: _Events, first, ids: list[str], include_usage: bool) -> AsyncIterator[str]:
        index_of = {rid: i for i, rid in enumerate(ids)}
        sent_tokens: dict[int, int] = {}
        sent_text: dict[int, str] = {}
        try:
            # Each chunk names the version of the work item its choice belongs to; the first event
            # (a delta or the result) already carries it, so even the role chunks have it.
            first_print = self.fingerprint(first.adapter_step) if first is not None else None
            if self.chat:
                for i in range(len(ids) * self.n):
                    yield self._chunk([self._delta(i, None, None, role=True)], fingerprint=first_print)
            event = first
            idle = 0.0
            done: set[int] = set()
            # Invariant: sent_text[k] is exactly what the client has of choice k; a result is the
            # authority, so whatever deltas were lost or repeated, the client ends with its text.
            while True:
                if isinstance(event, TokenDelta):
                    k = index_of[event.request_id] * self.n + event.choice
                    if event.tokens > sent_tokens.get(k, 0) and k // self.n not in done:
                        sent_tokens[k] = event.tokens
                        sent_text[k] = sent_text.get(k, "") + event.text
                        yield self._chunk([self._delta(k, event.text, None)],
                                          fingerprint=self.fingerprint(event.adapter_step))
                elif isinstance(event, ResultItem) and event.index not in done:
                    done.add(event.index)
                    if event.error is not None:
                        err = {"error": {"message": event.error.message, "type": event.error.type,
                                         "code": event.error.status}}
                        yield f"data: {json.dumps(err)}\n\n"
                    for c in event.choices:
                        k = event.index * self.n + c.index
                        have = sent_text.get(k, "")
                        rest = c.text[len(have):] if c.text.startswith(have) else ""
                        yield self._chunk([self._delta(k, rest, _finish(c.finish_reason))],
                                          fingerprint=self.fingerprint(event.adapter_step))
                    if len(done) == len(ids):
                        break
                elif event is None:
                    idle += KEEPALIVE_S
                    if idle > ANSWER_TIMEOUT_S:
                        err = {"error": {"message": "no inference replica answered in time", "code": 504}}
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    yield ": keep-alive\n\n"
                try:
                    event = await events.next(KEEPALIVE_S)
                    idle = 0.0
                except ApiError:
                    event = None
            if include_usage:
                results = [events.results[i] for i in sorted(events.results)]
                yield self._chunk([], usage=_usage(results), fingerprint=self.fingerprint_of(results))
            yield "data: [DONE]\n\n"
        finally:
            await events.close()


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(results: list[ResultItem]) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
