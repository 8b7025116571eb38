"""Learning is real: the entry point trains an adapter that the reference engine then serves.

Three prompt -> completion pairs on the tiny model, trained with the documented recipe through
`python -m loopline.ml.train`, then generated greedily with the final checkpoint applied.
"""

from __future__ import annotations

import asyncio

import pytest

from loopline.common.adapter_format import FROZEN_BASE_TYPES
from loopline.inference.engine import GenerationRequest, Sampling
from loopline.inference.reference_engine import ReferenceEngine
from loopline.ml.train.checkpoint import latest_checkpoint


def generate(model_path: str, prompts: list[str], adapter=None) -> list[str]:
    async def go():
        engine = ReferenceEngine(model_path, max_model_len=None, dtype="float32", adapter=adapter)
        await engine.start()
        outs = []
        for i, prompt in enumerate(prompts):
            # As the completions endpoint builds a prompt: the raw text with the tokenizer's specials.
            ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
            text = ""
            async for delta in engine.generate(GenerationRequest(f"r{i}", ids, Sampling(max_tokens=24))):
                text += delta.text
            outs.append(text)
        return outs

    return asyncio.run(go())


def test_base_model_does_not_know_the_answers(jobs):
    outs = generate(jobs.model, [q for q, _ in jobs.pairs])
    assert all(out != answer for out, (_, answer) in zip(outs, jobs.pairs, strict=True))


@pytest.mark.parametrize("adapter_type", FROZEN_BASE_TYPES)
def test_trained_adapter_answers_all_three(jobs, adapter_type):
    job = jobs.write(adapter_type, {**jobs.recipe, "adapter_type": adapter_type})
    run = jobs.run(job)
    assert run.returncode == 0, run.stderr[-3000:]
    status = jobs.status(job)
    assert status["status"] == "COMPLETED" and status["step"] == jobs.recipe["max_steps"]
    assert status["history"][-1]["loss"] < 0.3 * status["history"][0]["loss"]

    step, checkpoint = latest_checkpoint(job)
    assert step == jobs.recipe["max_steps"]
    outs = generate(jobs.model, [q for q, _ in jobs.pairs], adapter=checkpoint)
    assert outs == [a for _, a in jobs.pairs]
