"""Request ids and groups, and turning ScalarLM prompts into work items (vLLM requests)."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from loopline.common.contracts.schemas import BatchManifest, WorkItem
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.model_directory import Route
from loopline.gateway.gateway import Gateway


@dataclass
class Prompt:
    """One ScalarLM prompt as the gateway understands it: plain text or chat messages."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None

    def as_request(self, model: str, max_tokens: int, temperature: float,
                   tools: dict[str, Any] | None = None) -> tuple[str, str]:
        """The vLLM route and JSON body that generate for this prompt: a completion for text, a
        chat completion for messages (the chat template and ``tools`` are vLLM's)."""
        params = {"model": model, "max_tokens": max_tokens, "temperature": temperature}
        if self.messages is not None:
            return "/v1/chat/completions", json.dumps({**params, **(tools or {}), "messages": self.messages})
        return "/v1/completions", json.dumps({**params, "prompt": self.text})


def request_id(group: str, index: int) -> str:
    # Zero-padded so ScalarLM's client, which sorts ids as strings in places, keeps prompt order.
    return f"{group}_{index:09d}"


# A group is what fresh_group (32 hex digits) or content_group (64) made: nothing else may reach a
# subject, where "*", ">" or "." would read or wait on other clients' results.
_GROUP = re.compile(r"[0-9a-f]{32}(?:[0-9a-f]{32})?")


# An index is a prompt's position in its batch, written with 9 digits; more than 18 never came
# from us (and past 4,300 digits int() refuses the text: that was a 500).
MAX_INDEX_DIGITS = 18


def split_request_id(rid: str) -> tuple[str, int]:
    group, _, index = rid.rpartition("_")
    if (not _GROUP.fullmatch(group) or not index.isdigit() or not index.isascii()
            or len(index) > MAX_INDEX_DIGITS):
        shown = rid if len(rid) <= 120 else f"{rid[:100]}… ({len(rid)} characters)"
        raise ApiError(400, f"malformed request id {shown!r}: expected <group>_<index> as this server "
                            f"returned it (at most {MAX_INDEX_DIGITS} index digits)", param="request_ids")
    return group, int(index)


def content_group(payload: Any) -> str:
    """ScalarLM batches are content-addressed: an identical resubmission finds its answers."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: a lone surrogate in a prompt is hashed too (vLLM then refuses the prompt).
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def owned_group(group: str, owner: str | None) -> str:
    """A content-addressed batch id of one API key's (auth/tenancy.py): another key sending the same
    content gets a batch of its own, never this one's answers. Without keys, ``group`` itself."""
    return group if owner is None else content_group({"group": group, "owner": owner})


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
                         max_tokens: int, temperature: float, *, kind: str, skip_if_known: bool = False,
                         tools: dict[str, Any] | None = None,
                         owner: str | None = None) -> tuple[list[str], bool]:
    """Publish one work item per prompt. Returns their request ids in prompt order, and whether
    the batch had been accepted before (then nothing is published: its work is queued or done)."""
    check_max_tokens(route, max_tokens)
    ids = [request_id(group, i) for i in range(len(prompts))]
    if skip_if_known and await gateway.work.manifest(group) is not None:
        return ids, True
    gateway.admission.admit(route.deployment, len(prompts))
    items = [work_item(route, rid, group, i, p, max_tokens, temperature, kind=kind, total=len(prompts),
                       tools=tools)
             for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))]
    # ScalarLM batches are polled for later, possibly through another gateway: a manifest says the
    # batch is known.
    manifest = BatchManifest(group=group, total=len(prompts), model=route.model, kind=kind, owner=owner)
    await gateway.work.publish(manifest, items, route.deployment)
    return ids, False


def work_item(route: Route, rid: str, group: str, index: int, prompt: Prompt, max_tokens: int,
              temperature: float, *, kind: str, total: int, tools: dict[str, Any] | None = None) -> WorkItem:
    # An adapter request names the job: the replica swaps in the version it pins.
    path, body = prompt.as_request(route.adapter or route.info.model, max_tokens, temperature, tools)
    return WorkItem(request_id=rid, group=group, index=index, model=route.model, route=path, body=body,
                    adapter=route.adapter, kind=kind, batch_total=total)
