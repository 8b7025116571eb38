"""The recipe matrix's reinforcement-learning cases (support/recipe_matrix.RecipeCase), with the
stand-in data the ones that read the Hub or a download need.

rubric, guess_number and text_arena open a ServiceClient without a base_url (rubric's grader; the
two multiplayer recipes take no base_url at all), which the SDK resolves from $TINKER_BASE_URL: they
need the recipe's environment to carry the server's address. text_arena also imports ``textarena``,
an optional dependency of the cookbook (its ``multiplayer-rl`` extra)."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support import standins
from support.cookbook import MATH_RL, RecipeRun, math_rl_args
from support.recipe_matrix import STUDENT_RENDERER, RecipeCase, RecipeContext

Check = Callable[[RecipeRun, RecipeContext], None]


def trained_steps(steps: int, *metrics: str) -> Check:
    """A check: at least ``steps`` rows carry ``metrics`` (a step that trained logs them; the
    recipe's last row is only its token counts)."""

    def check(run: RecipeRun, ctx: RecipeContext) -> None:
        rows = [row for row in run.metrics if all(name in row for name in metrics)]
        assert len(rows) >= steps, (metrics, [sorted(row) for row in run.metrics])

    return check


def all_of(*checks: Check) -> Check:
    def check(run: RecipeRun, ctx: RecipeContext) -> None:
        for one in checks:
            one(run, ctx)

    return check


def final_checkpoint(run: RecipeRun, ctx: RecipeContext) -> None:
    """The recipe recorded its final checkpoint, weights for sampling included."""
    path = run.log_path / "checkpoints.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert any(r.get("name") == "final" and r.get("sampler_path") for r in records), records


# What a trained RL step of the cookbook logs: the optimizer's and the server's metrics, and the KL
# between the sampler's logprobs and the trainer's (the number stable_reinforce's reweighting rests on).
RL_STEP = ("optim/lr", "grad_norm:mean", "optim/kl_sample_train_v1")


def _math_rl(ctx: RecipeContext, **overrides: Any) -> dict[str, Any]:
    """math_rl on its own arithmetic problems, 2 steps, its default loss unless ``overrides`` name
    one; the renderer from the Qwen name's table (no renderer_name)."""
    return math_rl_args(ctx.base_url, ctx.student, ctx.log_path, renderer_name=None,
                        **{"loss_fn": None, "max_steps": 2, **overrides})


# Where rubric.train reads its data by default (relative to its cwd): the files its generate_data
# writes, which the package does not ship.
RUBRIC_DATA = Path("tinker_cookbook/example_data")


def rubric_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """rubric.generate_data's format: a few-shot addition convo and one rubric item on the sum."""
    rows = []
    for i in range(count):
        x, y = (seed * 37 + i * 101) % 1000, (seed * 11 + i * 53) % 1000
        rows.append({"convo": [{"role": "user", "content": "What is 4 + 5?"},
                               {"role": "assistant", "content": "9"},
                               {"role": "user", "content": f"What is {x} + {y}?"}],
                     "rubric_items": [{
                         "rubric_str": f"Does the chatbot correctly get the answer {x + y}?",
                         "extraction_regex": r"<score>(.*?)</score>",
                         "grader_output_format_instruction":
                             "Please output your score between 0 and 1 wrapped in <score> ... </score>"}]})
    return rows


def _rubric(ctx: RecipeContext) -> dict[str, Any]:
    """rubric.train on stand-in addition data at its default paths, graded by the teacher base
    model; 2 steps of 2 groups x 2 samples, 4 test points."""
    folder = ctx.work / RUBRIC_DATA
    for name, rows in (("train", rubric_rows(16, 1)), ("test", rubric_rows(4, 2))):
        standins.write_jsonl(folder / f"example_rubric_{name}.jsonl", rows)
    return {"base_url": ctx.base_url, "model_name": ctx.student, "renderer_name": STUDENT_RENDERER,
            "grader_llm_name": ctx.teacher, "grader_renderer_name": STUDENT_RENDERER,
            "groups_per_batch": 2, "train_group_size": 2, "max_tokens": 8, "max_steps": 2,
            "log_path": str(ctx.log_path), "behavior_if_log_dir_exists": "delete"}


def _guess_number(ctx: RecipeContext) -> dict[str, Any]:
    """guess_number: multi-turn games of up to 10 guesses, 2 games x 2 samples a step; no eval
    (its test set is ~100 games x 4 samples)."""
    return {"model_name": ctx.student, "renderer_name": STUDENT_RENDERER, "batch_size": 2,
            "group_size": 2, "max_tokens": 8, "eval_every": 0, "max_steps": 2,
            "log_path": str(ctx.log_path), "behavior_if_log_dir_exists": "delete"}


def _text_arena(ctx: RecipeContext) -> dict[str, Any]:
    """text_arena: TicTacToe self-play, one game (2 players) a step; eval at the start and the end
    on one game against its default opponent, the base model sampled through the server."""
    return {"model_name": ctx.student, "renderer_name": STUDENT_RENDERER, "batch_size": 2,
            "num_train_datapoints": 4, "num_test_datapoints": 2, "max_tokens": 16,
            "max_steps": 2, "log_path": str(ctx.log_path), "behavior_if_log_dir_exists": "delete"}


# Prophet Arena's CSV columns (forecasting.data reads them; markets, market_outcome and sources are
# JSON). Its default split date is 2025-10-20: events closed before it train, events after validate.
PROPHET_COLUMNS = ("submission_id", "event_ticker", "title", "snapshot_time", "close_time",
                   "market_outcome", "category", "markets", "sources")


def prophet_arena_rows(count: int) -> list[dict[str, str]]:
    """Binary markets of two outcomes an event: the first half before the split date, the rest
    after it."""
    rows = []
    for i in range(count):
        month = 8 if i < count // 2 else 11
        markets = [f"Team {i}A", f"Team {i}B"]
        sources = [{"title": f"Team {i}A season", "summary": f"Team {i}A won {i % 5} of its last 5.",
                    "ranking": 1}]
        rows.append({"submission_id": f"s{i}", "event_ticker": f"EV{i}",
                     "title": f"Team {i}A vs Team {i}B",
                     "snapshot_time": f"2025-{month:02d}-{1 + i:02d}T12:00:00+00:00",
                     "close_time": f"2025-{month:02d}-{2 + i:02d}T12:00:00+00:00",
                     "market_outcome": json.dumps({markets[0]: i % 2, markets[1]: 1 - i % 2}),
                     "category": "Sports", "markets": json.dumps(markets),
                     "sources": json.dumps(sources)})
    return rows


def write_prophet_arena(ctx: RecipeContext) -> Path:
    """The stand-in CSV both forecasting recipes take as data_path (they download the real one by
    URL, not through datasets, so the load_dataset shim cannot stand in)."""
    path = ctx.work / "subset_data_1200.csv"
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=PROPHET_COLUMNS)
        writer.writeheader()
        writer.writerows(prophet_arena_rows(12))
    return path


def _forecasting(ctx: RecipeContext) -> dict[str, Any]:
    """forecasting.train, 2 steps of 2 questions x 2 samples; its eval of the final checkpoint on
    2 questions."""
    path = write_prophet_arena(ctx)
    return {"base_url": ctx.base_url, "model_name": ctx.student, "renderer_name": STUDENT_RENDERER,
            "data_path": str(path), "group_size": 2, "groups_per_batch": 2,
            "validation_group_size": 1, "max_validation_questions": 2, "max_tokens": 16,
            "max_steps": 2, "log_path": str(ctx.log_path), "behavior_if_log_dir_exists": "delete"}


def _decisions_forecasting(ctx: RecipeContext) -> dict[str, Any]:
    """decisions.forecasting: 2 steps of 4 yes/no decisions, scored at the start and the end on 2
    validation questions; its renderer is its own default for the model name."""
    return {"base_url": ctx.base_url, "model_name": ctx.student,
            "data_path": str(write_prophet_arena(ctx)), "batch_size": 4, "max_steps": 2,
            "max_validation_questions": 2, "eval_every": 0, "log_path": str(ctx.log_path),
            "behavior_if_log_dir_exists": "delete"}


GSM8K = standins.key("openai/gsm8k", "main")


def gsm8k_rows(count: int, seed: int) -> list[dict[str, str]]:
    """openai/gsm8k "main": a word problem, and a worked answer ending in '#### <n>'."""
    rows = []
    for i in range(count):
        a, b = 3 + (seed * 7 + i * 5) % 40, 2 + (seed * 3 + i * 11) % 30
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                     "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"})
    return rows


def write_gsm8k(folder: Path) -> dict[str, Path]:
    return {"train": standins.write_jsonl(folder / "train.jsonl", gsm8k_rows(16, 1)),
            "test": standins.write_jsonl(folder / "test.jsonl", gsm8k_rows(8, 2))}


def _rl_basic(ctx: RecipeContext) -> dict[str, Any]:
    """rl_basic, 2 steps of 2 problems x 2 samples, 16 tokens. chz takes no sub-argument of the
    builder value the recipe applies, so the same builder class is named with every field it sets
    (the renderer its model table recommends for the name, as the recipe derives it)."""
    return {"base_url": ctx.base_url, "model_name": ctx.student, "log_path": str(ctx.log_path),
            "dataset_builder": "tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
            "dataset_builder.batch_size": 2, "dataset_builder.group_size": 2,
            "dataset_builder.renderer_name": STUDENT_RENDERER,
            "dataset_builder.model_name_for_tokenizer": ctx.student, "max_tokens": 16,
            "max_steps": 2}


def _rl_loop(ctx: RecipeContext) -> dict[str, Any]:
    """rl_loop, 2 steps of 2 problems x 2 samples, 16 tokens."""
    return {"base_url": ctx.base_url, "model_name": ctx.student, "log_path": str(ctx.log_path),
            "batch_size": 2, "group_size": 2, "max_tokens": 16, "max_steps": 2}


CASES: tuple[RecipeCase, ...] = (
    RecipeCase("math_rl", MATH_RL, _math_rl, "stable_reinforce",
               ("sampling", "record_stability_info", "forward_backward", "optim_step",
                "saved checkpoints"), check=trained_steps(2, *RL_STEP)),
    RecipeCase("math_rl (importance_sampling)", MATH_RL,
               lambda ctx: _math_rl(ctx, loss_fn="importance_sampling"), "importance_sampling",
               ("sampling", "forward_backward", "optim_step", "saved checkpoints"),
               check=trained_steps(2, *RL_STEP)),
    # gspo: the sequence-level ratio (tinker_worker/sequence_losses.py), through the recipe's CLI.
    RecipeCase("math_rl (gspo)", MATH_RL, lambda ctx: _math_rl(ctx, loss_fn="gspo"), "gspo",
               ("sampling", "forward_backward", "optim_step", "saved checkpoints"),
               check=trained_steps(2, *RL_STEP)),
    # max_steps_off_policy switches math_rl to rl.train's async loop (AsyncConfig, whose loss is
    # stable_reinforce by default): sampling runs up to one step ahead of training.
    RecipeCase("math_rl (async)", MATH_RL, lambda ctx: _math_rl(ctx, max_steps_off_policy=1),
               "stable_reinforce",
               ("sampling", "record_stability_info", "forward_backward", "optim_step",
                "saved checkpoints", "async off-policy"),
               check=trained_steps(2, *RL_STEP, "async/staleness_max")),
    RecipeCase("rubric", "tinker_cookbook.recipes.rubric.train", _rubric, "stable_reinforce",
               ("sampling", "record_stability_info", "forward_backward", "optim_step",
                "teacher base model", "saved checkpoints"), check=trained_steps(2, *RL_STEP)),
    RecipeCase("multiplayer_rl.guess_number", "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
               _guess_number, "importance_sampling",
               ("sampling", "forward_backward", "optim_step", "multi-turn env", "saved checkpoints"),
               check=trained_steps(2, *RL_STEP), timeout_s=400),
    RecipeCase("multiplayer_rl.text_arena", "tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
               _text_arena, "importance_sampling",
               ("sampling", "forward_backward", "optim_step", "multi-turn env", "saved checkpoints"),
               check=trained_steps(2, *RL_STEP)),
    RecipeCase("forecasting", "tinker_cookbook.recipes.forecasting.train", _forecasting,
               "importance_sampling", ("sampling", "forward_backward", "optim_step", "saved checkpoints"),
               check=trained_steps(2, *RL_STEP)),
    # Brier loss on the yes/no distribution through forward_backward_custom; the distribution is read
    # by sampling with target_prompt_logprobs at the answer position.
    RecipeCase("decisions.forecasting", "tinker_cookbook.recipes.decisions.forecasting",
               _decisions_forecasting, "brier (custom)",
               ("forward_backward_custom", "optim_step", "target_prompt_logprobs", "sampling",
                "saved checkpoints"),
               check=all_of(trained_steps(2, "train/loss", "train/accuracy"),
                            trained_steps(2, "test/brier_reward"))),
    RecipeCase("rl_basic", "tinker_cookbook.recipes.rl_basic", _rl_basic, "importance_sampling",
               ("sampling", "forward_backward", "optim_step", "saved checkpoints"),
               standins={GSM8K: write_gsm8k}, check=trained_steps(2, *RL_STEP)),
    # rl_loop skips a step's forward_backward when every group's rewards are equal, and the tiny
    # model never writes the \boxed{} answer its reward needs: here it samples (recording
    # stability info, as its stable_reinforce asks) and saves checkpoints, but does not train.
    RecipeCase("rl_loop", "tinker_cookbook.recipes.rl_loop", _rl_loop, "stable_reinforce",
               ("sampling", "record_stability_info", "saved checkpoints"),
               standins={GSM8K: write_gsm8k}, min_metric_rows=2,
               check=all_of(trained_steps(2, "reward/total"), final_checkpoint)),
)
