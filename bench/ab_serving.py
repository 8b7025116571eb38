"""A/B of two platform set-ups: two whole stacks side by side, taking turns burst by burst.

    python bench/ab_serving.py [--rounds 30] [--prompts 64] [--max-tokens 32]
                               [--a-env KEY=VALUE ...] [--b-env KEY=VALUE ...] [--out FILE]

On this kind of machine a change to the serving path moves (b)'s burst time by a few percent, while
the machine's own speed drifts by tens of percent from one minute to the next: two runs of
bench/serving.py on the same code gave throughput medians from 0.77 to 0.98. Here both set-ups run at
once, idle while the other bursts, and each round pairs one burst of A with one of B a second apart,
in alternating order. The figure is the median over rounds of B's burst time over A's.

Set-ups differ by environment: LOOPLINE_* settings, or PYTHONPATH naming a folder whose
sitecustomize.py patches the code under test. Even so, read it with care: with no difference at all,
one run gave B/A 1.058 (24 rounds), so two identical stacks can differ by several percent. Run a
null comparison first, then the real one twice with A and B swapped, and believe a difference only
where it shows in both orders and beyond the null run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import serving  # after the path and environment it needs


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--a-env/--b-env want KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


async def alternate(stacks: dict, args) -> dict[str, list[float]]:
    paths = {}
    for label, stack in stacks.items():
        path = serving.PlatformPath(stack, args.model, args.max_tokens)
        await path.start()
        tap = serving.Tap(stack.nats_url)
        await tap.open()
        paths[label] = (path, tap)
    prompts = serving.make_prompts(args.prompts, args.seed)
    warmup = serving.make_prompts(args.prompts, args.seed + 1)
    try:
        for path, _ in paths.values():
            await asyncio.gather(*(path.one(t) for t in warmup))
            await asyncio.gather(*(path.one(t) for t in prompts))
        gc.collect()
        gc.freeze()
        walls: dict[str, list[float]] = {label: [] for label in paths}
        labels = list(paths)
        for r in range(args.rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                path, _ = paths[label]
                # Neither stack's ledger is still writing the last burst while this one runs.
                for _, tap in paths.values():
                    await tap.ledger_caught_up()
                await asyncio.sleep(serving.SETTLE_S)
                started = time.perf_counter()
                samples = await asyncio.gather(*(path.one(t) for t in prompts))
                walls[label].append(time.perf_counter() - started)
                if any(s.tokens != args.max_tokens for s in samples):
                    print(f"  note: {label} generated fewer than {args.max_tokens} tokens for some prompts")
            print(f"  round {r + 1}/{args.rounds}: " + "  ".join(
                f"{label} {walls[label][-1] * 1e3:.0f} ms" for label in labels), flush=True)
        return walls
    finally:
        for path, tap in paths.values():
            await tap.close()
            await path.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--a-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--b-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ab_serving.json"))
    args = parser.parse_args()
    envs = {"A": parse_env(args.a_env), "B": parse_env(args.b_env)}

    from loopline.common.local.stack import LocalStack
    from loopline.ml.models.resolve import resolve_model

    dirs, stacks = [], {}
    try:
        for label, env in envs.items():
            state = Path(tempfile.mkdtemp(prefix=f"loopline-ab-{label}-"))
            dirs.append(state)
            resolve_model(args.model, state / "models")
            print(f"{label}: starting a stack in {state} with {env or 'no changes'}", flush=True)
            stacks[label] = LocalStack(state_dir=state, model=args.model, replicas=1, env=env)
            stacks[label].start()
        walls = asyncio.run(alternate(stacks, args))
    finally:
        for stack in stacks.values():
            stack.stop()
        for state in dirs:
            shutil.rmtree(state, ignore_errors=True)

    ratios = [b / a for a, b in zip(walls["A"], walls["B"], strict=True)]
    ms = 1e3
    print()
    print(f"A/B, {args.prompts} prompts x {args.max_tokens} tokens per burst, {args.rounds} rounds")
    for label in ("A", "B"):
        p25, p50, p75 = (serving.percentile(walls[label], q) * ms for q in (25, 50, 75))
        print(f"  {label} {envs[label] or '(as is)'}: burst p50 {p50:.0f} ms, p25 {p25:.0f}, p75 {p75:.0f}")
    print(f"  B/A burst time, median of rounds: {serving.percentile(ratios, 50):.3f} "
          f"(p25 {serving.percentile(ratios, 25):.3f}, p75 {serving.percentile(ratios, 75):.3f}); "
          "below 1: B is faster")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "envs": envs, "prompts": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "b_over_a": serving.summary(ratios), "walls_s": walls,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
