"""Learning is real: the entry point trains an adapter whose checkpoint then answers its pairs.

Three prompt -> completion pairs on the tiny model, trained with the documented recipe through
`python -m loopline.ml.train`, then generated greedily by transformers with the final checkpoint
applied (support/greedy.py: the prompt as /v1/completions tokenizes it, 24 new tokens).
"""

from __future__ import annotations

import pytest

from loopline.common.contracts.adapter_format import FROZEN_BASE_TYPES
from loopline.ml.train.checkpoint import latest_checkpoint
from support.greedy import greedy_texts

# Tier: trains until the adapter answers, 20-60 s each.
pytestmark = pytest.mark.slow


def test_base_model_does_not_know_the_answers(jobs):
    outs = greedy_texts(jobs.model, [q for q, _ in jobs.pairs])
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
    outs = greedy_texts(jobs.model, [q for q, _ in jobs.pairs], checkpoint=checkpoint)
    assert outs == [a for _, a in jobs.pairs]
