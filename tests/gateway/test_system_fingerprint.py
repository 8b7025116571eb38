"""Which checkpoint answered: ``system_fingerprint`` = ``<job>@<step>`` in OpenAI responses (JSON
and every SSE chunk) and ``adapter_step`` in ScalarLM results, built from the step the inference
worker pinned (``ResultItem.adapter_step`` / ``TokenDelta.adapter_step``); absent for the base model.

The response shaping is exercised directly (no NATS): what the routes send is exactly this."""

from __future__ import annotations

import asyncio
import json

from loopline.common.schemas import Choice, ResultItem, TokenDelta
from loopline.gateway.openai_api import _Shape
from loopline.gateway.scalarlm_api import result_entry
from loopline.gateway.submit import request_id

JOB = "ab" * 32


def result(index: int, text: str, step: int | None) -> ResultItem:
    return ResultItem(request_id=request_id("g", index), group="g", index=index, model=JOB,
                      choices=[Choice(text=text, finish_reason="stop", completion_tokens=2)],
                      adapter_step=step)


class FakeEvents:
    """What _Shape.sse reads from: the events after the first one, and the results seen."""

    def __init__(self, events: list, results: dict[int, ResultItem]):
        self.events, self.results = list(events), results

    async def next(self, timeout_s: float):
        return self.events.pop(0)

    async def close(self) -> None:
        pass


def sse_objects(shape: _Shape, first, rest: list, results: dict, ids: list[str]) -> list[dict]:
    async def go():
        return [chunk async for chunk in shape.sse(FakeEvents(rest, results), first, ids, True)]

    chunks = asyncio.run(go())
    assert chunks[-1] == "data: [DONE]\n\n"
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]


def test_json_responses_name_the_version_and_the_base_model_has_none():
    for chat in (False, True):
        shape = _Shape(chat=chat, model="latest", id="x", n=1, adapter=JOB)
        assert shape.response([result(0, " hi", 7)])["system_fingerprint"] == f"{JOB}@7"
        base = _Shape(chat=chat, model="tiny", id="x", n=1)
        assert "system_fingerprint" not in base.response([result(0, " hi", None)])
    # Several prompts in one completions request may be pinned to different versions.
    shape = _Shape(chat=False, model=JOB, id="x", n=1, adapter=JOB)
    both = shape.response([result(0, "a", 9), result(1, "b", 8)])
    assert both["system_fingerprint"] == f"{JOB}@8,{JOB}@9"


def test_every_sse_chunk_names_the_version():
    for chat in (False, True):
        shape = _Shape(chat=chat, model=JOB, id="x", n=1, adapter=JOB)
        done = result(0, " hi there", 3)
        first = TokenDelta(request_id="g_000000000", text=" hi", tokens=1, adapter_step=3)
        rest = [TokenDelta(request_id="g_000000000", text=" there", tokens=2, adapter_step=3), done]
        objects = sse_objects(shape, first, rest, {0: done}, ["g_000000000"])
        assert len(objects) >= 3 and all(o["system_fingerprint"] == f"{JOB}@3" for o in objects)

        base = _Shape(chat=chat, model="tiny", id="x", n=1)
        plain = result(0, " hi", None)
        objects = sse_objects(base, plain, [], {0: plain}, ["g_000000000"])
        assert objects and all("system_fingerprint" not in o for o in objects)


def test_scalarlm_results_carry_the_step_only_for_adapters():
    entry = result_entry("g_000000000", result(0, " hi", 5))
    assert entry["adapter_step"] == 5 and entry["response"] == " hi" and entry["error"] is None
    assert "adapter_step" not in result_entry("g_000000000", result(0, " hi", None))
