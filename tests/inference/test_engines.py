"""The two engines behind one interface: the transformers reference engine and vLLM agree."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from loopline.common.schemas import SamplingParams, WorkItem
from loopline.inference.engine import vllm_available
from loopline.inference.prompts import PromptBuilder, PromptError
from loopline.inference.reference_engine import ReferenceEngine, held_back
from support.stacks import tiny_model

PROMPTS = ["The quick brown fox", "What is the capital of France?", "1 2 3 4", "Hello there, friend"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(tiny):
    # Loading binds nothing to an event loop, so one engine serves every test's loop.
    engine = ReferenceEngine(tiny, max_model_len=None, dtype="float32")
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def builder(reference):
    return PromptBuilder(reference.tokenizer, reference.info.max_model_len)


_ids = itertools.count()


def item(prompt: str, **sampling) -> WorkItem:
    return WorkItem(request_id=f"r-{next(_ids)}", group="g", index=0,
                    model="tiny", prompt=prompt, sampling=SamplingParams(**{"max_tokens": 16, **sampling}))


async def run(engine, request) -> tuple[list[str], list[str | None], list[int]]:
    n = request.sampling.n
    texts, reasons, counts = [""] * n, [None] * n, [0] * n
    async for delta in engine.generate(request):
        texts[delta.choice] += delta.text
        counts[delta.choice] = delta.tokens
        reasons[delta.choice] = delta.finish_reason or reasons[delta.choice]
    return texts, reasons, counts


def test_held_back_keeps_possible_stop_prefixes():
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello", ("xyz",)) == 0
    assert held_back("ab", ("b", "abc")) == 2


async def test_reference_matches_transformers_generate(reference, builder, tiny):
    import torch

    request = builder.build(item(PROMPTS[0]))
    texts, reasons, counts = await run(reference, request)
    out = reference.model.generate(torch.tensor([request.prompt_token_ids]), max_new_tokens=16,
                                   do_sample=False)
    expected = reference.tokenizer.decode(out[0][len(request.prompt_token_ids):], skip_special_tokens=True)
    assert texts[0] == expected and counts[0] == 16 and reasons[0] == "length"


async def test_reference_stop_and_seed(reference, builder):
    full, _, _ = await run(reference, builder.build(item(PROMPTS[1])))
    stop = full[0][5:8]
    cut, reasons, _ = await run(reference, builder.build(item(PROMPTS[1], stop=[stop])))
    assert reasons[0] == "stop" and full[0].startswith(cut[0]) and stop not in cut[0]
    a, _, _ = await run(reference, builder.build(item(PROMPTS[2], temperature=1.0, seed=3, n=2)))
    b, _, _ = await run(reference, builder.build(item(PROMPTS[2], temperature=1.0, seed=3, n=2)))
    assert a == b and len(a) == 2


def test_prompt_too_long_for_the_context_is_refused(builder):
    with pytest.raises(PromptError) as err:
        builder.build(item("word " * (builder.max_model_len + 1), max_tokens=16))
    assert err.value.status == 400 and "maximum context length" in err.value.message
    with pytest.raises(PromptError):
        builder.build(item(""))


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
async def test_vllm_and_reference_agree_on_greedy_text(reference, builder, tiny):
    from loopline.inference.vllm_engine import VllmEngine

    engine = VllmEngine(tiny, max_model_len=None, max_num_seqs=8, dtype="auto")
    await engine.start()
    try:
        for prompt in PROMPTS:
            request = builder.build(item(prompt))
            assert await run(engine, request) == await run(reference, request), prompt
    finally:
        await engine.stop()
