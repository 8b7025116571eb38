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
