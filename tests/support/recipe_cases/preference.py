"""Recipe matrix cases: preference learning (shorter, DPO, the RLHF pipeline) and on-policy
distillation (one teacher, several teachers), with the stand-ins of the Hub datasets they read.

Every case keeps its recipe's loss and algorithm defaults and shrinks only sizes (steps, batch,
group, tokens, rank where noted), so each runs 2 steps on the tiny model. Recipes that take no
``base_url`` (shorter, the RLHF pipeline) reach the server through ``TINKER_BASE_URL``, which the
frame's ``run_case`` must set (with ``TINKER_COOKBOOK_RUNS_DIR``); the pipeline takes no
``log_path`` either, so ``run_case`` reads its metrics where ``RecipeCase.log_dir`` says.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from support import standins
from support.cookbook import RecipeRun
from support.recipe_matrix import STUDENT_RENDERER, RecipeCase, RecipeContext
from support.standins import supervised_data

# --- stand-in data: a few rows of each Hub dataset's own columns -------------------------------

# Short question/answer pairs the stand-ins are made of: (question, good answer, worse answer).
_QA = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"I think it is {a + b + 1}, maybe.")
       for a, b in ((2, 3), (4, 1), (7, 5), (6, 6), (9, 2), (3, 8), (5, 4), (1, 9), (8, 7), (2, 2))]


def _hh_rows(offset: int, count: int) -> list[dict[str, str]]:
    """Anthropic/hh-rlhf rows: ``chosen`` and ``rejected`` are whole transcripts that share every
    turn but the last assistant one (the recipe drops rows where they differ elsewhere)."""
    rows = []
    for i in range(offset, offset + count):
        question, good, bad = _QA[i % len(_QA)]
        prefix = f"\n\nHuman: {question}\n\nAssistant:"
        rows.append({"chosen": f"{prefix} {good}", "rejected": f"{prefix} {bad}"})
    return rows


def hh_rlhf(folder: Path) -> dict[str, Path]:
    return {"train": standins.write_jsonl(folder / "train.jsonl", _hh_rows(0, 8)),
            "test": standins.write_jsonl(folder / "test.jsonl", _hh_rows(8, 2))}


def deepmath(folder: Path) -> dict[str, Path]:
    """zwhe99/DeepMath-103K (train only; the recipe reads ``question``)."""
    rows = [{"question": question, "final_answer": good.split()[-1].rstrip("."), "difficulty": 1.0,
             "topic": "Mathematics -> Algebra -> Prealgebra -> Integers",
             "r1_solution_1": good, "r1_solution_2": good, "r1_solution_3": good}
            for question, good, _ in _QA[:8]]
    return {"train": standins.write_jsonl(folder / "train.jsonl", rows)}


def tulu3(folder: Path) -> dict[str, Path]:
    """allenai/tulu-3-sft-mixture (train only; the recipe reads the first user message)."""
    rows = [{"id": f"stand-in-{i}", "source": "stand-in",
             "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": good}]}
            for i, (question, good, _) in enumerate(_QA[2:10])]
    return {"train": standins.write_jsonl(folder / "train.jsonl", rows)}


# --- checks -----------------------------------------------------------------------------------

# The student's own base scores its samples with a KL of sampling noise only (its LoRA starts at
# zero); the teacher, a perturbed copy, scores them measurably apart. Measured at the first step
# on the tiny model: 0.0 against its own base, 0.5-0.9 against the teacher.
TEACHER_KL_FLOOR = 0.05


def _first_row_with(run: RecipeRun, key: str) -> dict[str, Any]:
    rows = [row for row in run.metrics if key in row]
    assert rows, f"no {key!r} in metrics.jsonl:\n{run.tail()}"
    return rows[0]


def _finite(row: dict[str, Any], key: str) -> float:
    value = row[key]
    assert isinstance(value, float) and math.isfinite(value), (key, row)
    return value


def teacher_answered(run: RecipeRun, ctx: RecipeContext) -> None:
    """On-policy distillation scored the student's samples with the teacher base model: the first
    step's teacher KL is finite and beyond what the student's own base would give."""
    kl = _finite(_first_row_with(run, "teacher_kl"), "teacher_kl")
    assert abs(kl) > TEACHER_KL_FLOOR, f"teacher_kl {kl}: was {ctx.teacher} asked at all?"


def each_teacher_answered(run: RecipeRun, ctx: RecipeContext) -> None:
    """Multi-teacher: DeepMath's teacher is ctx.teacher, Tulu3's is ctx.student's base. At the first
    step (the student still its base) only the first is measurably apart: each dataset's prompts
    went to its own base model."""
    row = _first_row_with(run, "teacher_kl/dataset_0")
    by_teacher, by_own_base = (_finite(row, f"teacher_kl/dataset_{i}") for i in (0, 1))
    assert abs(by_teacher) > TEACHER_KL_FLOOR, f"{ctx.teacher}'s KL {by_teacher}"
    assert abs(by_own_base) < TEACHER_KL_FLOOR, f"{ctx.student}'s own base: KL {by_own_base}"


def post_update_scored(run: RecipeRun, ctx: RecipeContext) -> None:
    """shorter keeps compute_post_kl on: each step scores its samples again with the updated LoRA
    (prompt logprobs on an adapter, the request that once killed the engine)."""
    _finite(_first_row_with(run, "kl_pre_post_v1"), "kl_pre_post_v1")


# --- cases ------------------------------------------------------------------------------------


def _common(ctx: RecipeContext) -> dict[str, Any]:
    return {"model_name": ctx.student, "log_path": str(ctx.log_path),
            "behavior_if_log_dir_exists": "delete"}


def shorter_args(ctx: RecipeContext) -> dict[str, Any]:
    # Pairwise self-play against a preference model that prefers the shorter answer (a local
    # function, no model); compute_post_kl stays on (the recipe sets it). No base_url argument:
    # the server comes from TINKER_BASE_URL. The renderer is the student's
    # (the default, qwen3_5_disable_thinking, is Qwen3.5's template, not the tiny tokenizer's).
    return {**_common(ctx), "renderer_name": STUDENT_RENDERER, "batch_size": 2, "group_size": 2,
            "max_tokens": 16, "eval_every": 0, "max_steps": 2}


def dpo_args(ctx: RecipeContext) -> dict[str, Any]:
    # Default dataset "hhh" (Anthropic/hh-rlhf), dpo_beta 0.1, linear schedule; the reference is
    # the reference_model_name-less default: a sampling client saved from the initial weights
    # (save_weights_and_get_sampling_client), scored with compute_logprobs on that LoRA. The
    # renderer is resolved from model_name's table entry (qwen3_instruct).
    return {**_common(ctx), "base_url": ctx.base_url, "batch_size": 2, "max_steps": 2}


def rlhf_args(ctx: RecipeContext) -> dict[str, Any]:
    # All three stages in one process (run_sft, run_rm, run_rl default True): SFT on NoRobots, a
    # reward model on HHH comparisons, then RL against it from the SFT checkpoint. max_steps caps
    # each stage; batch_size is shared. The renderer comes from base_model's table entry.
    return {"base_model": ctx.student, "short_name": "matrix", "batch_size": 2, "lora_rank": 8,
            "rl_max_tokens": 16, "rl_group_size": 2, "max_steps": 2}


def rlhf_log_dir(ctx: RecipeContext) -> Path:
    """The pipeline logs under the runs directory (TINKER_COOKBOOK_RUNS_DIR): the RL stage's log."""
    return ctx.work / "runs" / "rlhf-matrix" / "rl"


def on_policy_args(ctx: RecipeContext) -> dict[str, Any]:
    # Default dataset deepmath, importance_sampling, kl_penalty_coef 1; renderer from the table.
    return {**_common(ctx), "base_url": ctx.base_url, "teacher_model": ctx.teacher,
            "groups_per_batch": 2, "group_size": 2, "max_tokens": 16, "lora_rank": 8,
            "eval_every": 0, "save_every": 0, "max_steps": 2}


def multi_teacher_args(ctx: RecipeContext) -> dict[str, Any]:
    # DeepMath's teacher is the server's teacher base, Tulu3's the student's own base (two teachers
    # on two bases). The recipe's default student is Qwen3.5-9B; it is the student stand-in here.
    return {**_common(ctx), "base_url": ctx.base_url, "deepmath_teacher_model": ctx.teacher,
            "tulu3_teacher_model": ctx.student, "deepmath_groups_per_batch": 2,
            "tulu3_groups_per_batch": 2, "group_size": 2, "max_tokens": 16, "lora_rank": 8,
            "eval_every": 0, "save_every": 0, "max_steps": 2}


CASES: tuple[RecipeCase, ...] = (
    RecipeCase(
        name="preference.shorter",
        module="tinker_cookbook.recipes.preference.shorter.train",
        args=shorter_args,
        default_loss="importance_sampling",
        features=("forward_backward", "optim_step", "sampling", "compute_logprobs"),
        check=post_update_scored,
    ),
    RecipeCase(
        name="preference.dpo",
        module="tinker_cookbook.recipes.preference.dpo.train",
        args=dpo_args,
        default_loss="dpo (custom)",
        features=("forward_backward_custom", "optim_step", "saved checkpoints", "compute_logprobs"),
        standins={"Anthropic/hh-rlhf": hh_rlhf},
    ),
    RecipeCase(
        name="preference.rlhf",
        module="tinker_cookbook.recipes.preference.rlhf.rlhf_pipeline",
        args=rlhf_args,
        default_loss="cross_entropy (SFT, reward model), importance_sampling (RL)",
        features=("forward_backward", "optim_step", "sampling", "saved checkpoints"),
        standins={"HuggingFaceH4/no_robots": supervised_data.no_robots, "Anthropic/hh-rlhf": hh_rlhf},
        log_dir=rlhf_log_dir,
        timeout_s=600,
    ),
    RecipeCase(
        name="distillation.on_policy",
        module="tinker_cookbook.recipes.distillation.on_policy_distillation",
        args=on_policy_args,
        default_loss="importance_sampling",
        features=("forward_backward", "optim_step", "sampling", "compute_logprobs",
                  "teacher base model"),
        standins={"zwhe99/DeepMath-103K": deepmath},
        check=teacher_answered,
    ),
    RecipeCase(
        name="distillation.on_policy_multi_teacher",
        module="tinker_cookbook.recipes.distillation.on_policy_multi_teacher",
        args=multi_teacher_args,
        default_loss="importance_sampling",
        features=("forward_backward", "optim_step", "sampling", "compute_logprobs",
                  "teacher base model"),
        standins={"zwhe99/DeepMath-103K": deepmath, "allenai/tulu-3-sft-mixture": tulu3},
        check=each_teacher_answered,
    ),
)
