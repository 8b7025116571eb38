"""tinker-cookbook 0.6.1's recipes, unmodified and offline, against a whole Loopline stack on the tiny
model: the supervised one (``chat_sl`` on the conversations it ships) and the RL one (``math_rl`` on
the arithmetic task it generates itself), each a few steps.

What is checked is what a cookbook user sees: the recipe exits 0, writes one metrics row a step with
finite values, and the checkpoints it recorded in ``checkpoints.jsonl`` are the ones the server
lists for its training run. The RL run saves part-way (``save_every``), so its later iterations
sample from a named sampler checkpoint's ``tinker://`` path, not from an ephemeral save. That the RL
recipe learns is shown on SmolLM2 by docs/tinker/run_cookbook.sh, too long for the suite.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from loopline.common.contracts import subjects
from support.bus_view import BusView
from support.cookbook import (
    CHAT_SL,
    MATH_RL,
    REPO,
    chat_sl_args,
    cookbook_python,
    math_rl_args,
    recipe_env,
    run_recipe,
)

STEPS = 3
# Each recipe takes ~20 s on the tiny model; the first test also waits for the cookbook's venv
# (~1 min when it must be installed). A hung recipe is killed well inside pytest's own timeout.
RECIPE_TIMEOUT_S = 300


@pytest.fixture(scope="module", autouse=True)
def cookbook() -> Path:
    return cookbook_python()


def server_json(stack, path: str) -> Any:
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        response = client.get(path)
        response.raise_for_status()
        return response.json()


def recorded_checkpoints(log_path: Path) -> list[dict[str, Any]]:
    """The rows the recipe appended to checkpoints.jsonl, one per save (state and/or sampler path)."""
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()
            if line.strip()]


def assert_the_server_holds(stack, checkpoints: list[dict[str, Any]]) -> dict[str, Any]:
    """Every tinker path the recipe recorded is a checkpoint the server lists for its training run,
    and that run is among the training runs; returns the run."""
    paths = {row[key] for row in checkpoints for key in ("state_path", "sampler_path") if key in row}
    assert paths, checkpoints
    run_ids = {path.removeprefix("tinker://").split("/")[0] for path in paths}
    assert len(run_ids) == 1, paths  # one training client per recipe run
    run_id = run_ids.pop()
    runs = server_json(stack, "/api/v1/training_runs?limit=100")["training_runs"]
    run = next((r for r in runs if r["training_run_id"] == run_id), None)
    assert run is not None, [r["training_run_id"] for r in runs]
    listed = server_json(stack, f"/api/v1/training_runs/{run_id}/checkpoints")["checkpoints"]
    assert paths <= {c["tinker_path"] for c in listed}, (paths, listed)
    return run


def test_chat_sl_recipe_trains_and_its_checkpoints_are_on_the_server(tinker_stack, tiny, tmp_path):
    log_path = tmp_path / "chat_sl"
    run = run_recipe(CHAT_SL, chat_sl_args(tinker_stack.url, tiny, log_path, max_steps=STEPS, save_every=2),
                     timeout=RECIPE_TIMEOUT_S)
    assert run.returncode == 0, run.tail()
    assert [row["step"] for row in run.metrics] == list(range(STEPS)), run.metrics
    for row in run.metrics:
        # The mean negative log-likelihood of the trained tokens (~10 nats on the untrained tiny model).
        assert math.isfinite(row["train_mean_nll"]) and 0 < row["train_mean_nll"] < 20, row
        assert row["num_tokens"] > 0, row
    checkpoints = recorded_checkpoints(log_path)
    assert [c["name"] for c in checkpoints][-1] == "final", checkpoints
    run_info = assert_the_server_holds(tinker_stack, checkpoints)
    assert run_info["base_model"] == tiny and run_info["lora_rank"] == 32, run_info
    assert run_info["last_checkpoint"]["tinker_path"] == checkpoints[-1]["state_path"], run_info


def test_math_rl_recipe_runs_its_iterations_and_samples_from_its_saved_checkpoint(tinker_stack, tiny,
                                                                                    tmp_path):
    log_path = tmp_path / "math_rl"
    run = run_recipe(MATH_RL, math_rl_args(tinker_stack.url, tiny, log_path, max_steps=STEPS, save_every=2),
                     timeout=RECIPE_TIMEOUT_S)
    assert run.returncode == 0, run.tail()
    # One row an iteration; after them the recipe logs the final step's number alone (no final eval).
    iterations = [row for row in run.metrics if "env/all/reward/total" in row]
    assert [row["step"] for row in iterations] == list(range(STEPS)), run.metrics
    for row in iterations:
        assert row["env/all/total_episodes"] == 8 * 4, row  # groups_per_batch x group_size
        # The arithmetic task's reward: 1 for the right answer, minus 0.1 for a badly formatted one.
        assert -0.1 <= row["env/all/reward/total"] <= 1, row
        # The sampler's logprobs against the trainer's: near 0 when both run the same weights.
        for key in ("optim/entropy", "optim/kl_sample_train_v1", "optim/kl_sample_train_v2"):
            assert math.isfinite(row[key]), (key, row)
        assert abs(row["optim/kl_sample_train_v1"]) < 0.05, row
    checkpoints = recorded_checkpoints(log_path)
    # The periodic save at step 2 (state and sampler weights, its sampler then sampled from), the final.
    assert [c["name"] for c in checkpoints] == ["000002", "final"], checkpoints
    assert all("sampler_path" in c and "state_path" in c for c in checkpoints), checkpoints
    run_info = assert_the_server_holds(tinker_stack, checkpoints)
    assert run_info["last_sampler_checkpoint"]["tinker_path"] == checkpoints[-1]["sampler_path"], run_info


def test_math_rl_recipe_with_its_default_loss_trains_with_stable_reinforce(tinker_stack, tiny, tmp_path):
    """No ``loss_fn``: the recipe's default, stable_reinforce, samples with record_stability_info and
    sends every datum with provenance spans; its 2 iterations run and its checkpoints are listed."""
    log_path = tmp_path / "math_rl_default"
    run = run_recipe(MATH_RL, math_rl_args(tinker_stack.url, tiny, log_path, max_steps=2, loss_fn=None),
                     timeout=RECIPE_TIMEOUT_S)
    assert run.returncode == 0, run.tail()
    config = json.loads((log_path / "config.json").read_text())
    assert config["loss_fn"] == "stable_reinforce", config
    iterations = [row for row in run.metrics if "env/all/reward/total" in row]
    assert [row["step"] for row in iterations] == [0, 1], run.metrics
    for row in iterations:
        assert row["env/all/total_episodes"] == 8 * 4, row
        assert math.isfinite(row["optim/kl_sample_train_v1"]), row
    checkpoints = recorded_checkpoints(log_path)
    assert [c["name"] for c in checkpoints][-1] == "final", checkpoints
    assert_the_server_holds(tinker_stack, checkpoints)

    async def records(nc) -> int:  # one per sample request that asked for stability info
        info = await nc.jetstream().stream_info(subjects.TINKER_FUTURES_STREAM,
                                                subjects_filter=subjects.tinker_sample_record("*"))
        return len(info.state.subjects or {})

    # 8 problems a step, one request of 4 samples each: what the worker checked the data against.
    assert BusView(tinker_stack.nats_url, "cookbook-test").ask(records) >= 2 * 8


# bench/rl_recipe_parity.py on the tiny model: within this (nats of a datum's summed response
# logprob) the server's sampler, trainer and post-step adapter equal the in-process computation
# (measured on SmolLM2: 0.0016, 0.0041, 0.0041 after 8 steps; float32 on both sides).
PARITY_NATS = 0.02


@pytest.mark.parametrize("loss", ["importance_sampling", "stable_reinforce"])
def test_the_recipes_training_path_computes_what_one_process_computes(tinker_stack, tiny, loss):
    """The recipe loop's own calls (pipelined train_step with provenance, unnamed and periodic named
    sampler saves, zero-advantage steps that AdamW's momentum still moves) give, step by step, the
    logprobs that the same LoRA, loss and AdamW give in one process: issue 24's check that a run
    through the platform learns what the computation in-process learns."""
    bench = REPO / "bench" / "rl_recipe_parity.py"
    run = subprocess.run([str(cookbook_python()), str(bench), tinker_stack.url, "--model", str(tiny),
                          "--loss", loss], capture_output=True, text=True, env=recipe_env(),
                         timeout=RECIPE_TIMEOUT_S, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 8, run.stdout
    worst = json.loads(run.stdout.split("largest differences ", 1)[1].splitlines()[0])
    assert set(worst) == {"sampler", "trainer", "after"}, worst
    assert max(worst.values()) < PARITY_NATS, run.stdout
