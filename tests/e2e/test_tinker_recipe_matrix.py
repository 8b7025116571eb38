"""Issue 24's recipe matrix: every tinker-cookbook 0.6.1 recipe whose data can be had offline runs
unmodified, with its own defaults, for 2-3 steps on the tiny model against one Loopline stack that
serves a student and a teacher; the recipes whose data only the Hub has run on local stand-ins of the
same columns (support/standins). The cases are in support/recipe_cases; docs/tinker.md's recipe
table is checked against them (tests/common/test_recipe_table.py).

Each case must exit 0 and log its steps; after each, the server must still serve both base models
(an engine a recipe's request killed would fail every later case, so each case checks it itself).
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from support.cookbook import cookbook_python
from support.recipe_matrix import (
    STUDENT,
    TEACHER,
    TEACHER_FOLDER,
    RecipeCase,
    all_cases,
    context,
    make_teacher,
    models,
    run_case,
    stack_env,
)
from support.stacks import make_stack

pytestmark = pytest.mark.recipes


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tiny):
    cookbook_python()  # the venv first: a failed install fails here, with the script's output
    state = tmp_path_factory.mktemp("recipe-matrix")
    teacher = make_teacher(Path(tiny), state / TEACHER_FOLDER)
    stack = make_stack(state / "stack", models(Path(tiny), teacher), **stack_env(Path(tiny), teacher))
    stack.start()
    yield stack, Path(tiny), teacher, state / "cases"
    stack.stop()


def still_serves(url: str) -> None:
    """A completion from each base model, answered: nothing a recipe sent killed an engine."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for model in (STUDENT, TEACHER):
            response = client.post("/v1/completions", json={"model": model, "prompt": "1 + 1 =",
                                                            "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200, (model, response.text)
            assert response.json()["choices"][0]["text"] is not None


@pytest.mark.parametrize("case", all_cases(), ids=lambda case: case.name)
def test_recipe_runs_unmodified_with_its_defaults(matrix, case: RecipeCase):
    stack, tiny, teacher, work = matrix
    ctx = context(stack.url, tiny, teacher, work, case.name)
    run = run_case(case, ctx)
    assert run.returncode == 0, f"{case.module} exited {run.returncode}:\n{run.tail()}"
    assert len(run.metrics) >= case.min_metric_rows, run.tail()
    for row in run.metrics:
        for name, value in row.items():
            if isinstance(value, float):
                assert not math.isnan(value), (name, row)
    if case.check is not None:
        case.check(run, ctx)
    still_serves(stack.url)


def test_a_teacher_and_a_student_each_train_sample_and_score_on_their_own_base(matrix):
    """Two base models on one server, as distillation needs: a training client, sampling and
    compute_logprobs on each, each answered by its own engine and its own session worker."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    stack, tiny, *_ = matrix
    with tinker.ServiceClient(base_url=stack.url, api_key="tml-loopline-test") as service:
        # Both bases share the tiny tokenizer; the SDK's get_tokenizer would look the Hub name up online.
        tokens = AutoTokenizer.from_pretrained(tiny).encode("The quick brown fox jumps over the lazy dog")
        prompt = types.ModelInput.from_ints(tokens)
        scored: dict[str, list[float | None]] = {}
        runs = {}
        for base in (STUDENT, TEACHER):
            training = service.create_lora_training_client(base_model=base, rank=4, seed=1).result()
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(
                                    np.array(tokens[1:], dtype=np.int64))})
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            tuned = training.save_weights_and_get_sampling_client("matrix-" + base.split("/")[-1]).result()
            answer = tuned.sample(prompt=prompt, num_samples=1,
                                  sampling_params=types.SamplingParams(max_tokens=3, seed=1)).result()
            assert len(answer.sequences[0].tokens) == 3
            base_client = service.create_sampling_client(base_model=base).result()
            scored[base] = base_client.compute_logprobs(prompt).result()
            assert tuned.compute_logprobs(prompt).result()[1:] != scored[base][1:]  # the adapter counts
            runs[base] = training.model_id
    # Other weights, other logprobs: each base was scored by its own engine.
    student, teacher = (np.array(scored[b][1:], dtype=np.float64) for b in (STUDENT, TEACHER))
    assert np.abs(student - teacher).max() > 1e-3
    rest = tinker.RestClient(base_url=stack.url, api_key="tml-loopline-test")
    for base, run_id in runs.items():
        assert rest.get_training_run(run_id).result().base_model == base
