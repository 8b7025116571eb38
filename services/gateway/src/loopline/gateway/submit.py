"""Turning accepted prompts into work items, shared by the OpenAI and ScalarLM routes."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from loopline.common.schemas import BatchManifest, SamplingParams, WorkItem
from loopline.gateway.errors import ApiError
from loopline.gateway.gateway import Gateway
from loopline.gateway.model_directory import Route


@dataclass
class Prompt:
    """One prompt as the gateway understands it: plain text or chat messages."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None


def request_id(group: str, index: int) -> str:
    # Zero-padded so ScalarLM's client, which sorts ids as strings in places, keeps prompt order.
    return f"{group}_{index:09d}"


def split_request_id(rid: str) -> tuple[str, int]:
    group, _, index = rid.rpartition("_")
    if not group or not index.isdigit():
        raise ApiError(400, f"malformed request id {rid!r}: expected <group>_<index>", param="request_ids")
    return group, int(index)


def content_group(payload: Any) -> str:
    """ScalarLM batches are content-addressed: an identical resubmission finds its answers."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def fresh_group() -> str:
    return uuid.uuid4().hex


def check_max_tokens(route: Route, max_tokens: int) -> None:
    if max_tokens > route.max_model_len:
        raise ApiError(
            400,
            f"max_tokens={max_tokens} is beyond this model's context length of "
            f"{route.max_model_len} tokens; lower it",
            param="max_tokens",
        )


async def submit_prompts(gateway: Gateway, route: Route, group: str, prompts: list[Prompt],
                         sampling: SamplingParams, *, kind: str, stream: bool = False,
                         skip_if_known: bool = False, reply_to: str | None = None) -> tuple[list[str], bool]:
    """Publish one work item per prompt. Returns their request ids in prompt order, and whether
    the batch had been accepted before (then nothing is published: its work is queued or done).
    ``reply_to``: where the replica also sends each result at once (Answers.expect)."""
    check_max_tokens(route, sampling.max_tokens)
    ids = [request_id(group, i) for i in range(len(prompts))]
    if skip_if_known and await gateway.work.manifest(group) is not None:
        return ids, True
    gateway.admission.admit(route.deployment, len(prompts))
    items = [
        WorkItem(request_id=rid, group=group, index=i, model=route.model, prompt=p.text,
                 messages=p.messages, sampling=sampling, stream=stream, adapter=route.adapter,
                 kind=kind, batch_total=len(prompts), reply_to=reply_to)
        for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))
    ]
    # OpenAI requests are answered on the connection that made them, so they need no manifest;
    # ScalarLM batches are polled for later, possibly through another gateway.
    manifest = None if kind == "openai" else BatchManifest(
        group=group, total=len(prompts), model=route.model, kind=kind)
    await gateway.work.publish(manifest, items, route.deployment)
    return ids, False
