"""One RL iteration through Loopline against the same computation in one process (issue 26).

    .venv-cookbook/bin/python bench/rl_loop.py [--iterations 8] [--warmup 1] \
        [--out bench/results/rl_loop.json]

The cookbook's math_rl iteration (arithmetic env, SmolLM2, 8 problems x 4 samples x 16 tokens, rank
32, importance sampling; bench/rl_in_process.py) run two ways, taking turns in one run: in this
process (transformers, the LoRA, loss and AdamW the server computes) and through a Loopline stack
the bench starts with the platform's defaults (``loopline up``: only the model, the state folder
and free ports are set). Both draw their LoRA from the same seed and see the same problems; who goes
first flips every round. It prints each round, then the median ratio Loopline / in-process of the
rounds after ``--warmup``, the pooled ratio, and each side's split: sampling, training, the save of
the new weights to a sampler (save -> served; the first sample from them is in sampling) and the
rest (the cookbook's own work in this process, the same on both sides).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rl_in_process as ip  # first: it puts the venv's packages (the tinker SDK) ahead of bench/

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.3
SPLIT = ("sampling_s", "train_s", "save_s", "other_s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """``loopline up`` with the platform's defaults, in a process group of its own."""

    def __init__(self, model: str, state_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = state_dir / "up.log"
        env = {**os.environ, "LOOPLINE_STATE_DIR": str(state_dir / "state"), "LOOPLINE_MODEL": model,
               "LOOPLINE_PORT": str(self.port), "LOOPLINE_NATS_PORT": str(free_port()),
               "LOOPLINE_NATS_MONITOR_PORT": str(free_port())}
        # The platform's own settings come from its defaults, not from this shell.
        for key in [k for k in env if k.startswith("LOOPLINE_") and k not in (
                "LOOPLINE_STATE_DIR", "LOOPLINE_MODEL", "LOOPLINE_PORT", "LOOPLINE_NATS_PORT",
                "LOOPLINE_NATS_MONITOR_PORT")]:
            del env[key]
        with self.log.open("w") as out:
            self.process = subprocess.Popen([str(REPO / ".venv/bin/loopline"), "up"], env=env,
                                            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                            start_new_session=True)

    def wait_up(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        # Invariant: the stack's process is alive and has not yet said it serves.
        while "Loopline is up" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the stack did not come up; its log:\n{self.log.read_text()[-4000:]}")
            time.sleep(1)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


def summary(rows: list[dict], warmup: int) -> dict:
    """Ratios and medians of the rounds after the warm-up."""
    timed = [r for r in rows if r["round"] >= warmup]
    ratios = [r["loopline"]["seconds"] / r["in_process"]["seconds"] for r in timed]
    pooled = (sum(r["loopline"]["seconds"] for r in timed)
              / sum(r["in_process"]["seconds"] for r in timed))
    split = {side: {k: statistics.median(r[side][k] for r in timed) for k in ("seconds", *SPLIT)}
             for side in ("in_process", "loopline")}
    return {"rounds": len(timed), "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
            "max_ratio": max(ratios), "pooled_ratio": pooled, "split_medians_s": split}


def print_summary(result: dict) -> None:
    s = result["summary"]
    verdict = "PASS" if s["median_ratio"] <= TARGET else "MISS"
    print(f"\niteration time, Loopline / in-process, median of {s['rounds']} rounds: "
          f"{s['median_ratio']:.2f}x (range {s['min_ratio']:.2f}-{s['max_ratio']:.2f}, pooled "
          f"{s['pooled_ratio']:.2f}x; target <= {TARGET}x: {verdict})")
    print(f"{'median seconds':<16}" + "".join(f"{k.removesuffix('_s'):>11}" for k in ("seconds", *SPLIT)))
    for side, split in s["split_medians_s"].items():
        print(f"{side:<16}" + "".join(f"{split[k]:>11.2f}" for k in ("seconds", *SPLIT)))


async def run(args: argparse.Namespace) -> dict:
    dataset = await ip.load_dataset(args)
    adam = ip.adam_params(args)
    local = ip.InProcess(args, dataset.renderer.tokenizer)
    with tempfile.TemporaryDirectory(prefix="rl-loop-") as work:
        stack = Stack(args.model, Path(work))
        try:
            stack.wait_up()
            args.server = stack.url
            print(f"stack up at {stack.url}, defaults (logs: {work}/state/logs)", flush=True)
            server = await ip.Server.start(args)
            rows: list[dict] = []
            for step in range(args.iterations):
                sides: list[tuple[str, ip.Executor]] = [("in_process", local), ("loopline", server)]
                if step % 2:
                    sides.reverse()
                row: dict = {"round": step, "first": sides[0][0]}
                for name, executor in sides:
                    row[name] = await ip.iteration(executor, dataset, step, adam, args)
                rows.append(row)
                print(json.dumps({"round": step, **{f"{side}_{k}": row[side][k]
                                                    for side in ("in_process", "loopline")
                                                    for k in ("seconds", *SPLIT, "env/all/reward/total")}}),
                      flush=True)
        finally:
            stack.stop()
    return {"args": {k: v for k, v in vars(args).items() if k != "server"}, "rows": rows,
            "summary": summary(rows, args.warmup)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ip.add_arguments(parser)
    parser.add_argument("--iterations", type=int, default=8, help="rounds (one iteration each side)")
    parser.add_argument("--warmup", type=int, default=1, help="first rounds left out of the ratios")
    parser.add_argument("--out", default=str(REPO / "bench/results/rl_loop.json"))
    args = parser.parse_args()
    if args.iterations <= args.warmup:
        parser.error("--iterations must exceed --warmup")
    result = asyncio.run(run(args))
    print_summary(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
