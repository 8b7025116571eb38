"""The cookbook's async RL against its sync RL on one Loopline stack (issue 26, item 3).

    .venv-cookbook/bin/python bench/rl_async.py [--rounds 2] [--steps 6] [--model FOLDER] \
        [--out bench/results/rl_async.json]

math_rl, unmodified (the arithmetic env, 8 problems x 4 samples x 16 tokens a step, importance
sampling, SmolLM2 by default), run by its own CLI against a stack ``loopline up`` starts with the
platform's defaults: once as is (sync: sample step k, then train on it) and once with
``max_steps_off_policy=1`` (async: sampling for step k+1 overlaps training on step k), taking turns
for ``--rounds`` rounds. A step's time is the gap between two rows of the recipe's metrics.jsonl
appearing (polled every 50 ms), so it counts everything the recipe waits for; the first step of a
run (its start-up) is left out. It prints each run's median step time, the median ratio async /
sync, and the staleness the async steps report (the ``staleness:*`` metrics the server adds to
``optim_step``, which the recipe logs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_loop import REPO, Stack

MODEL = str(REPO / ".loopline/models/SmolLM2-135M-Instruct")
RECIPE = "tinker_cookbook.recipes.math_rl.train"


def recipe_args(url: str, model: str, log_path: Path, steps: int, asynchronous: bool) -> list[str]:
    args = {"base_url": url, "model_name": model, "renderer_name": "role_colon", "env": "arithmetic",
            "group_size": 4, "groups_per_batch": 8, "max_tokens": 16, "max_steps": steps,
            "learning_rate": 3e-4, "lora_rank": 32, "loss_fn": "importance_sampling",
            "log_path": str(log_path), "behavior_if_log_dir_exists": "delete"}
    if asynchronous:
        args["max_steps_off_policy"] = 1
    return [f"{k}={v}" for k, v in args.items()]


def run_recipe(url: str, model: str, work: Path, steps: int, asynchronous: bool, round_: int) -> dict:
    """One recipe run: the time each metrics row appeared, and the rows."""
    # A folder of its own: an earlier run's metrics.jsonl would be seen before the recipe clears it.
    log_path = work / f"{'async' if asynchronous else 'sync'}-{round_}"
    metrics = log_path / "metrics.jsonl"
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "TOKENIZERS_PARALLELISM": "false", "TINKER_API_KEY": "tml-loopline",
           "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    out = (work / f"{log_path.name}.out").open("w")
    proc = subprocess.Popen([sys.executable, "-m", RECIPE, *recipe_args(url, model, log_path, steps,
                                                                          asynchronous)],
                            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work)
    seen: list[float] = []
    # Invariant: seen[i] is when the i-th line of metrics.jsonl was first seen.
    while proc.poll() is None:
        lines = metrics.read_text().count("\n") if metrics.exists() else 0
        seen.extend([time.monotonic()] * (lines - len(seen)))
        time.sleep(0.05)
    if proc.returncode != 0:
        sys.exit(f"the recipe failed ({proc.returncode}); its output:\n"
                 f"{(work / f'{log_path.name}.out').read_text()[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if "env/all/reward/total" in r]
    gaps = [b - a for a, b in itertools.pairwise(seen[:len(steps_rows)])]
    stale = [r.get("staleness:mean") for r in steps_rows]
    return {"mode": "async" if asynchronous else "sync", "step_s": gaps,
            "median_step_s": statistics.median(gaps), "staleness_mean": stale,
            "staleness_max": [r.get("staleness:max") for r in steps_rows],
            "reward": [r["env/all/reward/total"] for r in steps_rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps a run (its first is not timed)")
    parser.add_argument("--out", default=str(REPO / "bench/results/rl_async.json"))
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first is start-up)")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rl-async-") as tmp:
        work = Path(tmp)
        stack = Stack(args.model, work)
        try:
            stack.wait_up()
            print(f"stack up at {stack.url}, defaults", flush=True)
            for round_ in range(args.rounds):
                for asynchronous in ((False, True) if round_ % 2 == 0 else (True, False)):
                    run = run_recipe(stack.url, args.model, work, args.steps, asynchronous, round_)
                    runs.append({"round": round_, **run})
                    print(json.dumps({k: v for k, v in runs[-1].items() if k != "reward"}), flush=True)
        finally:
            stack.stop()
    by_mode = {m: [r["median_step_s"] for r in runs if r["mode"] == m] for m in ("sync", "async")}
    ratios = [a["median_step_s"] / s["median_step_s"] for a, s in zip(
        [r for r in runs if r["mode"] == "async"], [r for r in runs if r["mode"] == "sync"], strict=True)]
    stale = [x for r in runs if r["mode"] == "async" for x in r["staleness_mean"] if x is not None]
    summary = {"median_step_s": {m: statistics.median(v) for m, v in by_mode.items()},
               "ratio_async_over_sync": statistics.median(ratios), "ratios": ratios,
               "async_staleness_mean": statistics.mean(stale) if stale else None}
    print(f"\nstep time, median over runs: sync {summary['median_step_s']['sync']:.2f} s, async "
          f"{summary['median_step_s']['async']:.2f} s; async / sync {summary['ratio_async_over_sync']:.2f}x "
          f"(per round {', '.join(f'{r:.2f}' for r in ratios)}); async samples' mean staleness "
          f"{summary['async_staleness_mean']} steps")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
