"""The recipe matrix's parts: what a cookbook recipe case is, the stack it runs against, and how it
is run (tests/e2e/test_tinker_recipe_matrix.py; the cases are in support/recipe_cases).

The stack serves two base models, as a teacher and a student need: the tiny model as the student
and a perturbed copy of it as the teacher (same tokenizer, other weights), under Hub names the
cookbook's model table knows (``STUDENT``, ``TEACHER``), since several recipes derive their renderer
from ``model_name`` and take no ``renderer_name``. A recipe loads the tokenizer by that name too: it
runs in a folder where ``Qwen/Qwen3-4B-Instruct-2507`` is a link to the tiny model's folder, and
``transformers`` reads a local folder of that name before it asks the Hub.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loopline.common.local.stack import model_key
from support import standins
from support.cookbook import RecipeRun, run_recipe

# Hub names the cookbook's model table knows; Qwen3's instruct renderer is plain ChatML, as the tiny
# tokenizer is. The student is what recipes train; the teacher is the other base model on the server.
STUDENT = "Qwen/Qwen3-4B-Instruct-2507"
TEACHER = "Qwen/Qwen3-8B"
STUDENT_RENDERER = "qwen3_instruct"
TEACHER_FOLDER = "tiny-teacher"


@dataclass(frozen=True)
class RecipeContext:
    """Where one case runs: the server, the two base models, its own folders."""

    base_url: str
    student: str  # the student's served name (also a folder name under work: its tokenizer)
    teacher: str
    student_path: Path  # the tiny model's folder
    teacher_path: Path
    work: Path  # the recipe's working directory (holds the model-name links and stand-in data)
    log_path: Path  # the recipe's log_path (metrics.jsonl, checkpoints.jsonl)


@dataclass(frozen=True)
class RecipeCase:
    """One row of the matrix and of docs/tinker.md's recipe table."""

    name: str  # the row's name, e.g. "math_rl (async)"
    module: str  # run as ``python -m module key=value ...``
    args: Callable[[RecipeContext], dict[str, Any]]  # the key=value arguments (sized for 2-3 steps)
    default_loss: str  # the loss it trains with: the recipe's default unless the case names one
    features: tuple[str, ...]  # the Tinker features it exercises (docs/tinker.md's table)
    # Hub datasets it reads, each replaced by a local stand-in of the same columns.
    standins: Mapping[str, standins.StandIn] = field(default_factory=dict)
    check: Callable[[RecipeRun, RecipeContext], None] | None = None  # beyond exit 0 and metrics rows
    min_metric_rows: int = 1  # rows metrics.jsonl must hold after the run
    # Where a recipe that takes no ``log_path`` argument logs (it is run without one); None: log_path.
    log_dir: Callable[[RecipeContext], Path] | None = None
    timeout_s: float = 300


def models(tiny: Path, teacher: Path) -> str:
    """LOOPLINE_MODEL for the matrix stack: the student's deployment first (the default model)."""
    return f"{tiny},{teacher}"


def stack_env(tiny: Path, teacher: Path) -> dict[str, str]:
    """The matrix stack's variables beyond make_stack's: each deployment under its Hub name,
    session workers under the local launcher."""
    return {"LOOPLINE_LAUNCHER": "local", "LOOPLINE_RECONCILE_INTERVAL_S": "0.25",
            f"LOOPLINE_SERVED_MODEL_NAME__{model_key(str(tiny))}": STUDENT,
            f"LOOPLINE_SERVED_MODEL_NAME__{model_key(str(teacher))}": TEACHER}


def make_teacher(tiny: Path, dest: Path, scale: float = 0.02, seed: int = 7) -> Path:
    """A copy of the tiny model whose weights are moved by seeded noise: its own logprobs, the same
    tokenizer (distillation compares the two on the same tokens)."""
    import torch
    from safetensors.torch import load_file, save_file

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(tiny, dest)
    generator = torch.Generator().manual_seed(seed)
    for weights in dest.glob("*.safetensors"):
        tensors = load_file(weights)
        moved = {name: (t + scale * torch.randn(t.shape, generator=generator, dtype=torch.float32)
                        .to(t.dtype)) if t.is_floating_point() else t for name, t in tensors.items()}
        save_file(moved, weights, metadata={"format": "pt"})
    return dest


def context(base_url: str, tiny: Path, teacher: Path, work: Path, case_name: str) -> RecipeContext:
    """A fresh folder for one case, with the model-name links the recipe's tokenizer loads from."""
    folder = work / "".join(c if c.isalnum() else "_" for c in case_name).strip("_")
    if folder.exists():
        shutil.rmtree(folder)
    for name, path in ((STUDENT, tiny), (TEACHER, teacher)):
        link = folder / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path, target_is_directory=True)
    return RecipeContext(base_url, STUDENT, TEACHER, tiny, teacher, folder, folder / "log")


def run_case(case: RecipeCase, ctx: RecipeContext) -> RecipeRun:
    """Run ``case`` unmodified in ``ctx.work``, its stand-in data in place."""
    # Recipes without a base_url argument (preference.shorter, the RLHF pipeline) find the server
    # in the environment; those that log under the runs directory by default log in the case's folder.
    env = {"TINKER_BASE_URL": ctx.base_url, "TINKER_COOKBOOK_RUNS_DIR": str(ctx.work / "runs")}
    if case.standins:
        env.update(standins.environment(standins.write_table(ctx.work / "standins", case.standins)))
    return run_recipe(case.module, case.args(ctx), env=env, timeout=case.timeout_s, cwd=ctx.work,
                      log_path=case.log_dir(ctx) if case.log_dir else None)


def all_cases() -> list[RecipeCase]:
    """Every case of support/recipe_cases, in the order of docs/tinker.md's table."""
    from support.recipe_cases import CASES

    return list(CASES)


TABLE_START = "<!-- recipe-matrix: written by `python -m support.recipe_matrix table`; checked by tests -->"
TABLE_END = "<!-- /recipe-matrix -->"


def table(cases: list[RecipeCase]) -> str:
    """docs/tinker.md's recipe table: one row a case of the matrix, which must pass for main to land."""
    rows = [TABLE_START, "", "| recipe | module (`tinker_cookbook.recipes.`) | loss (the recipe's default "
            "unless the row names one) | Tinker features it uses | data here |", "|---|---|---|---|---|"]
    for case in cases:
        module = case.module.removeprefix("tinker_cookbook.recipes.")
        data = ", ".join(f"stand-in for `{name}`" for name in case.standins) or "its own"
        features = ", ".join(case.features)
        rows.append(f"| {case.name} | `{module}` | {case.default_loss} | {features} | {data} |")
    return "\n".join([*rows, "", TABLE_END])


def main() -> None:
    """For working on a case by hand, from tests/ (``table`` prints docs/tinker.md's recipe table):
    ``../.venv/bin/python -m support.recipe_matrix serve DIR`` starts the matrix stack (until ^C);
    ``../.venv/bin/python -m support.recipe_matrix run URL DIR "case name"`` runs one case against it
    (the same DIR: the teacher's folder is there; the case's files go to DIR/cases)."""
    import signal
    import sys
    import time

    from support.stacks import make_stack, tiny_model

    command, *rest = sys.argv[1:]
    if command == "table":
        print(table(all_cases()))
        return
    url_or_dir, *rest = rest
    tiny = Path(tiny_model())
    if command == "serve":
        state = Path(url_or_dir)
        teacher = make_teacher(tiny, state / TEACHER_FOLDER)
        stack = make_stack(state / "stack", models(tiny, teacher), **stack_env(tiny, teacher))
        stack.start()
        print(f"matrix stack up at {stack.url}", flush=True)
        # TERM as ^C, so a `kill` also stops the stack's processes (finally below), not only this one.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            while True:
                time.sleep(3600)
        finally:
            stack.stop()
    state, name = Path(rest[0]), rest[1]
    case = next(c for c in all_cases() if c.name == name)
    ctx = context(url_or_dir, tiny, state / TEACHER_FOLDER, state / "cases", case.name)
    run = run_case(case, ctx)
    print(run.tail(), f"\nexit {run.returncode}, {len(run.metrics)} metrics rows, log {run.log_path}")


if __name__ == "__main__":
    main()
