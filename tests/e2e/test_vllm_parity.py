"""Loopline's gateway answers exactly like ``vllm serve``: the definition of done of issue 14's item 1.

vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) and a Loopline stack
run the tiny model with the same ``vllm serve`` flags (one list, built by ``serve_flags``; the first
test proves the replica computes the same one from its settings). Every case of parity_cases.py
goes to both, as it is and, where the case says, streamed; the status codes and the JSON answers
(a stream's SSE events in order, ``[DONE]`` included, its deltas folded: see ``fold_stream``) must
be equal once generated ids and timestamps are replaced by placeholders and the fields Loopline
sets by design (``OURS``) are left out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from e2e.parity_cases import CASES, MODEL, Case

from loopline.inference.vllm_args import serve_flags
from support.stacks import make_stack
from support.vllm_serve import vllm_serve

pytestmark = pytest.mark.timeout(900)

MAX_INFLIGHT = 8
# hermes: its parser reads any tokenizer's text (a tool call is <tool_call>{json}</tool_call>),
# so "auto" works on the tiny model; the named and "required" choices need no parser at all.
VLLM_ARGS = "--enable-auto-tool-choice --tool-call-parser hermes"

# Fields whose value Loopline sets by design, left out of both sides before comparing. None on the
# base model: Loopline stamps its version (system_fingerprint) only on an adapter's answers
# (test_vllm_parity_adapters.py), so here even vLLM's config hash must match.
OURS: frozenset[str] = frozenset()
# Cases whose error message is Loopline's own, compared up to its first full stop (the rest of the
# body, type, param and code included, is compared as it is): the gateway routes models, so it
# answers an unknown one itself, before any replica, and lists what it serves (adapters too).
OWN_ERROR_MESSAGES = {"err-unknown-model"}

# Generated ids: a known prefix, then random letters (cmpl-9d12ceb8612fd202, resp_9dc6…,
# chatcmpl-tool-…). The prefix stays, so an id of the wrong kind is still a difference.
GENERATED_ID = re.compile(r"^(chatcmpl-tool-|chatcmpl-|cmpl-|resp_|msg_|rs_|fc_|call_|ft_)[A-Za-z0-9_-]+$")
TIMESTAMPS = frozenset({"created", "created_at", "completed_at"})


def is_id_key(key: str) -> bool:
    return key == "id" or key.endswith("_id")


def normalise(value: Any, ours: frozenset[str] = OURS) -> Any:
    """``value`` with generated ids and timestamps replaced by placeholders, ``ours`` left out."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in ours:
                continue
            if key in TIMESTAMPS and isinstance(item, (int, float)):
                out[key] = "<time>"
            elif is_id_key(key) and isinstance(item, str) and (generated := GENERATED_ID.match(item)):
                out[key] = generated.group(1) + "<id>"
            else:
                out[key] = normalise(item, ours)
        return out
    if isinstance(value, list):
        return [normalise(item, ours) for item in value]
    return value


@dataclass
class Answer:
    status: int
    # The JSON body (its text where it is not JSON), or for a stream its SSE events in order, each
    # {"event": the event line or None, "data": the data line's JSON, or "[DONE]"}.
    body: Any
    streamed: bool = False

    def comparable(self, ours: frozenset[str] = OURS) -> list[Any]:
        body = normalise(self.body, ours)
        return [self.status, fold_stream(body) if self.streamed else body]


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def sse_events(text: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    # Invariant: events holds the blocks before this one; a block is the lines up to a blank one.
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        if not block.strip():
            continue
        data = fields.get("data", "").strip()
        events.append({"event": fields["event"].strip() if "event" in fields else None,
                       "data": data if data == "[DONE]" else parse_json(data)})
    return events


# Streams are compared folded: vLLM merges the tokens that reach a request while its previous chunk
# is still being sent into one chunk (RequestOutputCollector.put), so where a stream's chunks split
# its text depends on timing, in vllm serve itself. Measured: sending each streamed case twice to
# one vllm serve split 10, then 18 of the 27 differently, while the folded forms were equal in
# every one of six runs. Folding concatenates the text of consecutive deltas (CONCAT), merges
# choices and tool calls by their "index", and keeps every other field's last non-null value; the
# events around the deltas, their order, the usage and the final [DONE] are compared as they are.
CONCAT = frozenset({"text", "content", "delta", "arguments", "reasoning", "reasoning_content", "refusal"})


def merge_delta(into: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        have = into.get(key)
        if value is None:
            into.setdefault(key, None)
        elif have is None:
            into[key] = value
        elif isinstance(value, str) and key in CONCAT:
            into[key] = have + value
        elif isinstance(value, dict) and isinstance(have, dict):
            merge_delta(have, value)
        elif isinstance(value, list) and isinstance(have, list):
            into[key] = merge_list(have, value)
        else:
            into[key] = value


def merge_list(have: list[Any], more: list[Any]) -> list[Any]:
    """Items with an "index" (choices, tool calls) merge with the item of the same index; any
    other list (tokens, logprobs, offsets) continues."""
    if not all(isinstance(item, dict) and "index" in item for item in (*have, *more)):
        return have + more
    by_index = {item["index"]: item for item in have}
    for item in more:
        if item["index"] in by_index:
            merge_delta(by_index[item["index"]], item)
        else:
            by_index[item["index"]] = item
    return [by_index[i] for i in sorted(by_index)]


def foldable(prev: dict[str, Any], event: dict[str, Any]) -> bool:
    """Whether ``event`` continues ``prev``: chunks of one completion, or Responses deltas."""
    a, b = prev["data"], event["data"]
    if prev["event"] != event["event"] or not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if "choices" in a and "choices" in b:
        return True
    return a.get("type") == b.get("type") and str(b.get("type")).endswith(".delta")


def fold_stream(events: list[dict[str, Any]]) -> list[Any]:
    folded: list[dict[str, Any]] = []
    # Invariant: folded is the events so far with each run of foldable ones merged into its first;
    # a Responses event's sequence_number (which counts chunks) is "<seq>" where it is its place.
    for place, event in enumerate(json.loads(json.dumps(events))):  # a copy: merging mutates
        data = event["data"]
        if isinstance(data, dict) and data.get("sequence_number") == place:
            data["sequence_number"] = "<seq>"
        if folded and foldable(folded[-1], event):
            merge_delta(folded[-1]["data"], data)
        else:
            folded.append(event)
    return folded


def send(client: httpx.Client, case: Case, *, stream: bool) -> Answer:
    if isinstance(case.body, str):
        body = case.body
    else:
        body = json.dumps(case.streamed_body() if stream else case.body)
    resp = client.post(case.route, content=body.encode(), headers={"content-type": "application/json"})
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return Answer(resp.status_code, sse_events(resp.text), streamed=True)
    return Answer(resp.status_code, parse_json(resp.text))


def first_difference(ours: Any, theirs: Any, path: str = "$") -> str | None:
    """Where two normalised answers first differ, as a JSON path with both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            if key not in ours or key not in theirs:
                mine, yours = ours.get(key, "<absent>"), theirs.get(key, "<absent>")
                return f"{path}.{key}: loopline {mine!r} vs vllm {yours!r}"
            found = first_difference(ours[key], theirs[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):  # lengths compared after
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        if len(ours) != len(theirs):
            return f"{path}: loopline has {len(ours)} items, vllm {len(theirs)}"
        return None
    return None if ours == theirs else f"{path}: loopline {ours!r} vs vllm {theirs!r}"


def flags(tiny: str) -> list[str]:
    return serve_flags(tiny, served_name=MODEL, max_inflight=MAX_INFLIGHT, adapters=False, extra=VLLM_ARGS)


@pytest.fixture(scope="module")
def loopline_stack(tmp_path_factory, tiny):
    stack = make_stack(tmp_path_factory.mktemp("parity-stack"), tiny, LOOPLINE_SERVED_MODEL_NAME=MODEL,
                       LOOPLINE_ADAPTERS="0", LOOPLINE_VLLM_ARGS=VLLM_ARGS,
                       LOOPLINE_MAX_INFLIGHT=str(MAX_INFLIGHT))
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def clients(tmp_path_factory, tiny, loopline_stack):
    log = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    with (vllm_serve(flags(tiny), log_path=log) as vllm_url,
          httpx.Client(base_url=vllm_url, timeout=120) as vllm,
          httpx.Client(base_url=loopline_stack.url, timeout=120) as loopline):
        yield loopline, vllm


def test_replica_runs_the_same_flags(tiny, loopline_stack, monkeypatch):
    """The flags the replica computes from the stack's settings are the ones vllm serve gets."""
    from loopline.common.config.settings import InferenceSettings
    from loopline.inference.service import flags_of

    for key, value in loopline_stack.env().items():
        monkeypatch.setenv(key, value)
    assert flags_of(InferenceSettings(), tiny) == flags(tiny)


PARAMS = [pytest.param(case, False, id=case.id) for case in CASES] + [
    pytest.param(case, True, id=f"{case.id}-stream") for case in CASES if case.stream]


def assert_same(case: Case, stream: bool, ours: Answer, theirs: Answer,
                own_fields: frozenset[str] = OURS) -> None:
    # A 5xx from vLLM itself would make this case test nothing worth matching.
    assert theirs.status < 500, f"vllm serve answered {theirs.status}: {theirs.body}"
    ours_now, theirs_now = ours.comparable(own_fields), theirs.comparable(own_fields)
    if case.id in OWN_ERROR_MESSAGES:
        for answer in (ours_now, theirs_now):
            error = answer[1]["error"]
            error["message"] = error["message"].split(". ")[0]
    where = first_difference(ours_now, theirs_now)
    assert where is None, (f"{case.id}{' (stream)' if stream else ''} differs at {where}\n"
                           f"loopline: {json.dumps(ours_now)[:3000]}\n"
                           f"vllm:     {json.dumps(theirs_now)[:3000]}")


@pytest.mark.parametrize(("case", "stream"), PARAMS)
def test_same_answer_as_vllm_serve(clients, case: Case, stream: bool):
    loopline, vllm = clients
    theirs = send(vllm, case, stream=stream)
    assert_same(case, stream, send(loopline, case, stream=stream), theirs)
