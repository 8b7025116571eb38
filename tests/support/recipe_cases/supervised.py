"""Recipe matrix cases: the supervised family (chat_sl, sl_basic, sl_loop, prompt_distillation,
sdft, distillation.off_policy_reasoning), each run unmodified with its own loss and renderer, shrunk
on the command line to 2 steps of 2-4 short rows. The Hub datasets they read are the stand-ins of
support/standins/supervised_data.py."""

from __future__ import annotations

from typing import Any

from support import standins
from support.cookbook import RecipeRun, chat_sl_args
from support.recipe_matrix import STUDENT_RENDERER, RecipeCase, RecipeContext
from support.standins import supervised_data

NO_ROBOTS = "HuggingFaceH4/no_robots"
SCIKNOWEVAL = "hicai-zju/SciKnowEval"
OPEN_THOUGHTS3 = "open-thoughts/OpenThoughts3-1.2M"
STEPS = 2
# The recipes that default to rank 128 (sdft, off_policy_reasoning) are given the largest rank the
# server serves by default (LOOPLINE_MAX_ADAPTER_RANK, 64): it answers 400 to a larger one.
SERVED_RANK = 64


def _common(ctx: RecipeContext) -> dict[str, Any]:
    """What every case names: the server, the student (the recipe's renderer follows its name), where
    to log."""
    return {"base_url": ctx.base_url, "model_name": ctx.student, "log_path": str(ctx.log_path)}


def chat_sl(ctx: RecipeContext) -> dict[str, Any]:
    """The shipped conversations, 4 a step; no renderer_name: the recipe picks the Qwen name's own."""
    args = chat_sl_args(ctx.base_url, ctx.student, ctx.log_path, batch_size=4, max_steps=STEPS)
    del args["renderer_name"]
    return args


def sl_basic(ctx: RecipeContext) -> dict[str, Any]:
    """NoRobots, 4 rows a step; its eval_every (8) evaluates the test split at step 0. The recipe has
    no behavior_if_log_dir_exists (it asks): the case's log folder is always new.

    The recipe hands chz its dataset builder as a finished value, whose fields chz then refuses to
    override one by one; so the case names the same builder class with the same common config as
    build_config_blueprint makes (the renderer model_info recommends for the student, max_length
    32768, all assistant messages), only batch_size shrunk from 128."""
    prefix = "dataset_builder.common_config."
    return {**_common(ctx), "max_steps": STEPS,
            "dataset_builder": "tinker_cookbook.recipes.chat_sl.chat_datasets:NoRobotsBuilder",
            f"{prefix}model_name_for_tokenizer": ctx.student, f"{prefix}renderer_name": STUDENT_RENDERER,
            f"{prefix}max_length": 32768, f"{prefix}batch_size": 4,
            f"{prefix}train_on_what": "all_assistant_messages"}


def sl_loop(ctx: RecipeContext) -> dict[str, Any]:
    """NoRobots, 4 rows a step, then its final save (state and sampler weights)."""
    return {**_common(ctx), "batch_size": 4, "max_steps": STEPS}


def prompt_distillation(ctx: RecipeContext) -> dict[str, Any]:
    """The training step on a stand-in of create_data.py's output file. create_data itself cannot run
    here unmodified: it samples from a hard-coded "Qwen/Qwen3.6-35B-A3B" (not served) at the default
    service address, and reads example_data/multilingual.txt relative to the working directory."""
    data = ctx.work / "prompt_distillation_lang.jsonl"
    standins.write_jsonl(data, supervised_data.prompt_distillation_rows())
    return {**_common(ctx), "file_path": str(data), "batch_size": 4, "max_steps": STEPS,
            "behavior_if_log_dir_exists": "delete"}


def sdft(ctx: RecipeContext) -> dict[str, Any]:
    """SciKnowEval (the default dataset, Chemistry), 2 questions a step, 16 sampled tokens; topk=20
    (the default) is kept, so each step trains on the teacher's top-20 prompt logprobs as soft targets.

    eval_every=0: the recipe's own test-set evaluation (due at step 0) fails in the client, whatever
    the server: RLTestSetEvaluator flattens the test SDFTDataset's batches as if they were lists of
    env group builders, but SDFTDataset.get_batch returns (builders, questions, golden_answers), so
    it calls make_envs() on a list (AttributeError)."""
    return {**_common(ctx), "groups_per_batch": 2, "max_tokens": 16, "max_steps": STEPS, "eval_every": 0,
            "lora_rank": SERVED_RANK, "behavior_if_log_dir_exists": "delete"}


def off_policy_reasoning(ctx: RecipeContext) -> dict[str, Any]:
    """OpenThoughts3 streamed, 4 conversations a step out of the first 16."""
    return {**_common(ctx), "batch_size": 4, "max_prompts": 16, "buffer_size": 16, "max_steps": STEPS,
            "lora_rank": SERVED_RANK, "behavior_if_log_dir_exists": "delete"}


def check_sdft_topk(run: RecipeRun, ctx: RecipeContext) -> None:
    """The steps took the top-K path: "sdft/topk" is only logged by the function that builds the
    (N, K) target_tokens/weights datums, and a positive teacher entropy means the weights spread over
    more than one token a position (soft targets, not one-hot)."""
    steps = [row for row in run.metrics if "sdft/topk" in row]
    assert len(steps) >= STEPS, run.tail()
    for row in steps:
        assert row["sdft/topk"] == 20, row
        assert row.get("sdft/total_completion_tokens", 0) > 0, row
        assert row.get("sdft/mean_teacher_entropy", 0) > 0, row


SUPERVISED = ("forward_backward", "optim_step", "saved checkpoints")

CASES: tuple[RecipeCase, ...] = (
    RecipeCase("chat_sl", "tinker_cookbook.recipes.chat_sl.train", chat_sl,
               default_loss="cross_entropy", features=SUPERVISED, min_metric_rows=STEPS),
    RecipeCase("sl_basic", "tinker_cookbook.recipes.sl_basic", sl_basic,
               default_loss="cross_entropy", features=(*SUPERVISED, "compute_logprobs"),
               standins={NO_ROBOTS: supervised_data.no_robots}, min_metric_rows=STEPS),
    RecipeCase("sl_loop", "tinker_cookbook.recipes.sl_loop", sl_loop,
               default_loss="cross_entropy", features=SUPERVISED,
               standins={NO_ROBOTS: supervised_data.no_robots}, min_metric_rows=STEPS),
    RecipeCase("prompt_distillation", "tinker_cookbook.recipes.prompt_distillation.train",
               prompt_distillation, default_loss="cross_entropy", features=SUPERVISED,
               min_metric_rows=STEPS),
    RecipeCase("sdft", "tinker_cookbook.recipes.sdft.train", sdft, default_loss="cross_entropy",
               features=(*SUPERVISED, "sampling", "prompt top-k logprobs", "soft-target cross_entropy"),
               standins={SCIKNOWEVAL: supervised_data.sciknoweval}, check=check_sdft_topk,
               min_metric_rows=STEPS),
    RecipeCase("distillation.off_policy_reasoning",
               "tinker_cookbook.recipes.distillation.off_policy_reasoning", off_policy_reasoning,
               default_loss="cross_entropy", features=SUPERVISED,
               standins={OPEN_THOUGHTS3: supervised_data.open_thoughts3}, min_metric_rows=STEPS),
)
