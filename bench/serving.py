"""Serving overhead: the same workload through ``vllm serve`` and through Loopline's gateway, in one run.

    python bench/serving.py [--model tiny] [--prompts 64] [--max-tokens 32] [--rounds 45]
                            [--latency-rounds 3] [--adapters on|off] [--vllm-args "FLAGS"]
                            [--out bench/results/serving.json] [--state-dir DIR]

  (a) ``vllm serve``: ``python -m vllm.entrypoints.openai.api_server``, started here with the flags
      a Loopline replica computes for the same settings (``flags_of``) and the replica's environment;
  (b) Loopline: HTTP -> gateway -> NATS JetStream -> replica (vLLM's own server in-process, the same
      flags) -> NATS -> gateway -> HTTP, started with ``LocalStack`` as ``make up`` does;
  (c) each of them with all prompts in one request (OpenAI's list ``prompt``): throughput only.

Both get the same requests from the same aiohttp client code (``/v1/completions``, greedy, same
``max_tokens``). Both stay up for the whole run and take turns, never running together: every
throughput round is one burst of all prompts through each (one request per prompt, all at once),
and the latency and time-to-first-token passes send each prompt through (a) and then (b), the order
alternating. So every figure of (b) has one of (a) taken a moment apart: on a shared 2-core
virtual machine the CPUs' own speed drifts by tens of percent over seconds. Ratios are medians of
the rounds' ratios, with their ranges. Before every burst the platform's bookkeeping of the
previous one (the ledger's consumers) has caught up. It always exits 0: targets are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The OpenMP default an inference replica applies (loopline/inference/__main__.py), before torch is
# imported: the stack inherits it and `vllm serve` gets it too, so both run the engine alike.
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) - 2)))

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # support.vllm_serve: the server the parity test uses too

from serving_paths import (  # noqa: E402 - after the path and environment they need
    ENV_SHOWN,
    HOP_NAMES,
    NOISY_SHARE,
    CpuMeter,
    Hops,
    HttpPath,
    PathResult,
    PlatformPath,
    Tap,
    make_prompts,
    percentile,
    platform_roles,
    summary,
    vllm_serve_roles,
)

# Targets of Loopline against `vllm serve`; reported, not enforced.
TARGET_THROUGHPUT_RATIO = 0.95
TARGET_ADDED_P50_MS = 5.0
WARMUP_SEQUENTIAL = 4
# Pause between two bursts, after the platform's bookkeeping has caught up.
SETTLE_S = 0.2
PATHS = {"a": "(a) vllm serve", "b": "(b) Loopline", "ca": "(c) vllm serve, 1 req",
         "cb": "(c) Loopline, 1 req"}


# --- the run: (a) and (b) take turns ------------------------------------------------------------------
def round_order(r: int) -> list[str]:
    """Round r's bursts: (a) and (b) next to each other, then both (c)s; who goes first within a
    pair flips every round, which pair goes first every other round."""
    pairs = [["a", "b"], ["ca", "cb"]]
    if r % 2:
        pairs = [p[::-1] for p in pairs]
    if (r // 2) % 2:
        pairs = pairs[::-1]
    return pairs[0] + pairs[1]


async def measure(a: HttpPath, b: PlatformPath, tap: Tap, roles: dict, prompts: list[str],
                  warmup: list[str], rounds: int, latency_rounds: int) -> tuple[dict, list[Hops]]:
    results = {key: PathResult() for key in PATHS}
    bursts = {"a": a.burst, "b": b.burst, "ca": a.batch, "cb": b.batch}
    meters = {key: CpuMeter(roles) for key in PATHS}

    async def settle() -> None:
        # (b)'s ledger writes come after its answers; let them finish before anything else runs.
        await tap.ledger_caught_up()
        await asyncio.sleep(SETTLE_S)

    for path in (a, b):
        for text in warmup[:WARMUP_SEQUENTIAL]:
            await path.one(text)
            await path.one(text, stream=True)
        await path.burst(warmup)
        await path.batch(warmup)
    # As every service does once it is up (loopline/common/runtime/service.py): this process's long-lived
    # heap out of the collector's way, so the client does not pause for it mid-burst.
    gc.collect()
    gc.freeze()

    for r in range(rounds):
        for key in round_order(r):
            await settle()
            meters[key].start("throughput")
            start = time.perf_counter()
            outs = await bursts[key](prompts)
            wall = time.perf_counter() - start
            meters[key].stop("throughput")
            res = results[key]
            res.round_wall_s.append(wall)
            res.round_tokens.append(sum(o.tokens for o in outs))
            if r == 0:
                res.texts = [o.text for o in outs]
        print(f"  round {r + 1}/{rounds}: " + "  ".join(
            f"{key} {results[key].round_wall_s[-1] * 1e3:.0f} ms" for key in PATHS), flush=True)

    await settle()
    await tap.watch()
    timed = []
    # Each pair differs by the engine's own jitter (a few ms either way here) as much as by the
    # platform, so one pass of the prompts pins the median down to about a millisecond;
    # latency_rounds passes narrow that.
    paired = [text for _ in range(latency_rounds) for text in prompts]
    # Invariant: pairs 0..i-1 have been measured through both paths, the first one alternating.
    for i, text in enumerate(paired):
        for key, path in ((("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))):
            meters[key].start("latency")
            sample = await path.one(text)
            meters[key].stop("latency")
            results[key].latency_s.append(sample.total)
            results[key].latency_tokens.append(sample.tokens)
            if key == "b":
                timed.append((i, text, sample))
    for i, text in enumerate(paired):
        for key, path in ((("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))):
            meters[key].start("ttft")
            sample = await path.one(text, stream=True)
            meters[key].stop("ttft")
            results[key].ttft_s.append(sample.ttft)
            results[key].stream_total_s.append(sample.total)
            results[key].stream_tokens.append(sample.tokens)
    # The tap's callbacks may run after the client already has its answer: look up last.
    await asyncio.sleep(0.2)
    await tap.unwatch()
    hops = [h for h in (tap.hops(*t) for t in timed) if h is not None]
    for key in PATHS:
        results[key].cpu = {"passes": meters[key].passes, "other_share": meters[key].other_share()}
    return results, hops


# --- report -----------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def ratios_of(x: PathResult, y: PathResult) -> dict:
    """y's throughput over x's: per round (median, range) and over all rounds pooled."""
    per_round = [ty / tx for tx, ty in zip(x.round_tok_per_s(), y.round_tok_per_s(), strict=True)]
    pooled = (sum(y.round_tokens) / sum(y.round_wall_s)) / (sum(x.round_tokens) / sum(x.round_wall_s))
    return {"median": percentile(per_round, 50), "rounds": summary(per_round), "pooled": pooled,
            "p25": percentile(per_round, 25), "p75": percentile(per_round, 75), "per_round": per_round}


def report(res: dict[str, PathResult], hops: list[Hops], args, flags: list[str], env_shown: dict) -> dict:
    ms = 1000.0
    a, b, ca, cb = (res[k] for k in PATHS)
    added = [(lb - la) * ms for la, lb in zip(a.latency_s, b.latency_s, strict=True)]
    added_ttft = [(tb - ta) * ms for ta, tb in zip(a.ttft_s, b.ttft_s, strict=True)]
    rb, rc = ratios_of(a, b), ratios_of(ca, cb)
    same_tokens = (a.round_tokens == b.round_tokens and ca.round_tokens == cb.round_tokens
                   and a.latency_tokens == b.latency_tokens and a.stream_tokens == b.stream_tokens)
    same_text = a.texts == b.texts and ca.texts == cb.texts
    added_p50, added_p99 = percentile(added, 50), percentile(added, 99)
    added_ttft_p50 = percentile(added_ttft, 50)
    hop_stats = {name: summary([(getattr(h, y) - getattr(h, x)) * ms for h in hops])
                 for name, x, y in HOP_NAMES}
    # The platform's own cost from (b) alone: the client's wait minus the replica's app call. Unlike
    # b - a it does not compare two moments of a machine others may be using.
    outside = [(h.received - h.sent - (h.finished - h.started)) * ms for h in hops]

    print()
    print(f"Loopline serving benchmark — model {args.model!r}, {args.prompts} prompts, max_tokens "
          f"{args.max_tokens}, greedy, {len(rb['per_round'])} throughput rounds, {len(added)} latency and "
          f"TTFT pairs ({args.latency_rounds} per prompt)")
    print(f"  (a) vllm serve {' '.join(flags)}")
    print("  (b) HTTP -> gateway -> NATS -> replica (vLLM's app, the same flags) -> NATS -> gateway -> HTTP")
    print(f"  (c) each with the {args.prompts} prompts in one request (throughput only)")
    print("  " + " ".join(f"{k}={v}" for k, v in env_shown.items()))
    print()
    row = "{:<32}" + "{:>23}" * 4
    print(row.format("throughput rounds", *PATHS.values()))
    print(row.format("tok/s (median round)",
                     *(f"{percentile(res[k].round_tok_per_s(), 50):.1f}" for k in PATHS)))
    print(row.format("burst wall, ms (median round)",
                     *(f"{percentile(res[k].round_wall_s, 50) * ms:.0f}" for k in PATHS)))
    print(row.format("generated tokens, first round", *(res[k].round_tokens[0] for k in PATHS)))
    print()
    row = "{:<34}{:>15}{:>15}{:>15}"
    print(row.format("one request at a time", "(a) vllm serve", "(b) Loopline", "b - a"))
    for q in (50, 90, 99):
        la, lb = percentile(a.latency_s, q) * ms, percentile(b.latency_s, q) * ms
        print(row.format(f"latency p{q}, ms", f"{la:.2f}", f"{lb:.2f}", f"{lb - la:+.2f}"))
    for q in (50, 99):
        ta, tb = percentile(a.ttft_s, q) * ms, percentile(b.ttft_s, q) * ms
        print(row.format(f"TTFT p{q}, ms", f"{ta:.2f}", f"{tb:.2f}", f"{tb - ta:+.2f}"))
    print()
    print(f"  tokens equal on every pass: {same_tokens}   texts equal (first round): {same_text}")
    print(f"  throughput b/a = {rb['median']:.3f} (median of rounds; range {rb['rounds']['min']:.3f}.."
          f"{rb['rounds']['max']:.3f}, p25..p75 {rb['p25']:.3f}..{rb['p75']:.3f}, pooled {rb['pooled']:.3f})"
          f"  target >= {TARGET_THROUGHPUT_RATIO}  {verdict(rb['median'] >= TARGET_THROUGHPUT_RATIO)}")
    print(f"  throughput (c) Loopline/vllm serve, one request of {args.prompts} prompts = {rc['median']:.3f} "
          f"(range {rc['rounds']['min']:.3f}..{rc['rounds']['max']:.3f}, pooled {rc['pooled']:.3f})")
    print(f"  added latency (b - a per pair) p50 = {added_p50:+.2f} ms  target <= {TARGET_ADDED_P50_MS} ms  "
          f"{verdict(added_p50 <= TARGET_ADDED_P50_MS)};  p90 = {percentile(added, 90):+.2f} ms;  "
          f"p99 = {added_p99:+.2f} ms")
    print(f"  added TTFT (b - a per pair) p50 = {added_ttft_p50:+.2f} ms, "
          f"p99 = {percentile(added_ttft, 99):+.2f} ms")
    if hops:
        print(f"  (b) time outside the replica's app call: p50 {percentile(outside, 50):.2f} ms, "
              f"p99 {percentile(outside, 99):.2f} ms  (the added latency within (b) alone)")
        print()
        print(f"  where a (b) request's time goes, latency pass ({len(hops)} requests), ms:")
        hrow = "    {:<38}{:>9}{:>9}{:>9}"
        print(hrow.format("hop", "p50", "p90", "p99"))
        for name, st in hop_stats.items():
            print(hrow.format(name, f"{st['p50']:.2f}", f"{st['p90']:.2f}", f"{st['p99']:.2f}"))

    for key, label in PATHS.items():
        passes = res[key].cpu["passes"]
        print()
        print(f"  CPU seconds by process per turn, {label} (machine has {os.cpu_count()} CPUs):")
        crow = "    {:<32}" + "{:>16}" * len(passes)
        turns = {p: max(passes[p]["turns"], 1) for p in passes}
        print(crow.format("pass (turns)", *(f"{p} ({turns[p]})" for p in passes)))
        print(crow.format("wall", *(f"{passes[p]['wall_s'] / turns[p]:.3f}" for p in passes)))
        for role in next(iter(passes.values()))["cpu_s"]:
            print(crow.format(role, *(f"{passes[p]['cpu_s'][role] / turns[p]:.3f}" for p in passes)))
        print(crow.format("other (not this benchmark)",
                          *(f"{passes[p]['other_cpu_s'] / turns[p]:.3f}" for p in passes)))
    busy = {f"{key} {p}": share for key in PATHS for p, share in res[key].cpu["other_share"].items()}
    noisy = {k: v for k, v in busy.items() if v > NOISY_SHARE}
    if noisy:
        print()
        print("  WARNING: other processes used a large share of the CPUs during "
              + ", ".join(f"{k} ({v:.0%})" for k, v in noisy.items())
              + ": these figures are skewed; rerun on a quiet machine.")

    return {
        "model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "rounds": len(rb["per_round"]), "latency_rounds": args.latency_rounds, "vllm_serve_flags": flags,
        "host": {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()},
        "env": env_shown,
        "targets": {"throughput_ratio": TARGET_THROUGHPUT_RATIO, "added_latency_p50_ms": TARGET_ADDED_P50_MS},
        "figures": {
            "throughput_tok_s_median_round": {k: percentile(res[k].round_tok_per_s(), 50) for k in PATHS},
            "throughput_ratio_b_over_a": rb,
            "throughput_pass": rb["median"] >= TARGET_THROUGHPUT_RATIO,
            "throughput_ratio_one_request_loopline_over_vllm_serve": rc,
            "added_latency_ms": summary(added),
            "added_latency_pass": added_p50 <= TARGET_ADDED_P50_MS,
            "latency_ms_a": summary([x * ms for x in a.latency_s]),
            "latency_ms_b": summary([x * ms for x in b.latency_s]),
            "ttft_ms_a": summary([x * ms for x in a.ttft_s]),
            "ttft_ms_b": summary([x * ms for x in b.ttft_s]),
            "added_ttft_ms": summary(added_ttft),
            "tokens_equal_every_pass": same_tokens,
            "texts_equal": same_text,
        },
        "hops_ms": hop_stats,
        "outside_replica_app_call_ms": summary(outside),
        "other_cpu_share": busy,
        "noisy": bool(noisy),
        "raw": {k: {f: v for f, v in vars(res[k]).items() if f != "texts"} for k in PATHS}
        | {"hops": [vars(h) for h in hops]},
    }


# --- main -------------------------------------------------------------------------------------------------
async def run_both(vllm_url: str, stack, args, keep_alive_s: float, prompts: list[str], warmup: list[str]):
    # The client lets idle connections go well before either server would (both keep them keep_alive_s).
    a = HttpPath("(a) vllm serve", vllm_url, args.served_name, args.max_tokens, keepalive_s=keep_alive_s / 2)
    b = PlatformPath(stack, args.served_name, args.max_tokens, keepalive_s=keep_alive_s / 2)
    tap = Tap(stack.nats_url)
    roles = {"client (this process)": [(os.getpid(), False)], **vllm_serve_roles(), **platform_roles(stack)}
    try:
        await a.start()
        await b.start()
        await tap.open()
        return await measure(a, b, tap, roles, prompts, warmup, args.rounds, args.latency_rounds)
    finally:
        await tap.close()
        await b.stop()
        await a.stop()


def stack_settings(env: dict[str, str]):
    """The replica's and the gateway's settings as they will read them from ``env``."""
    from loopline.common.config.settings import GatewaySettings, InferenceSettings

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return InferenceSettings(), GatewaySettings()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="what LOOPLINE_MODEL takes (tiny, a HF id, a folder)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=45, help="throughput rounds, each path once")
    parser.add_argument("--latency-rounds", type=int, default=3,
                        help="passes of the prompts, one request at a time, for latency and TTFT pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/serving.json"))
    parser.add_argument("--adapters", choices=("on", "off"), default=None,
                        help="run-time adapters (vLLM's LoRA support) on both sides "
                             "(default: the replica's default, LOOPLINE_ADAPTERS)")
    parser.add_argument("--vllm-args", default=None,
                        help="further `vllm serve` flags for both sides (LOOPLINE_VLLM_ARGS of the stack)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the stack keeps NATS data, logs and the model (default: a temp dir)")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from loopline.common.local.stack import LocalStack
    from loopline.inference.service import flags_of, prepare_model_folder
    from support.vllm_serve import serve_env, vllm_serve

    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="loopline-bench-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    env = {}
    if args.adapters is not None:
        env["LOOPLINE_ADAPTERS"] = "1" if args.adapters == "on" else "0"
    if args.vllm_args is not None:
        env["LOOPLINE_VLLM_ARGS"] = args.vllm_args
    stack = LocalStack(state_dir=state_dir, model=args.model, replicas=1, env=env)
    # What the replica will read (the stack's environment over ours), so the flags are its own.
    settings, gateway_settings = stack_settings(stack.env())
    args.served_name = settings.name
    # The gateway keeps idle connections for keep_alive_s; vLLM's server for 5 s unless told:
    # the same for both, so neither path pays for new connections the other does not.
    vllm_env = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(gateway_settings.keep_alive_s)}
    env_shown = {k: serve_env(vllm_env).get(k, "(unset)") for k in ENV_SHOWN}
    prompts = make_prompts(args.prompts, args.seed)
    warmup = make_prompts(args.prompts, args.seed + 1)
    try:
        # Into the stack's own models folder, the way the replica prepares it: the very same files.
        model_path = prepare_model_folder(settings)
        flags = flags_of(settings, model_path)
        print(f"(b) Loopline: starting LocalStack in {state_dir}", flush=True)
        try:
            stack.start()
            print(f"    gateway at {stack.url}", flush=True)
            print(f"(a) vllm serve {' '.join(flags)}", flush=True)
            with vllm_serve(flags, env=vllm_env, log_path=stack.logs / "vllm-serve.log") as vllm_url:
                print(f"    at {vllm_url}", flush=True)
                res, hops = asyncio.run(run_both(vllm_url, stack, args, gateway_settings.keep_alive_s,
                                                 prompts, warmup))
        finally:
            stack.stop()
            if stack.dead() != stack.procs():
                print("warning: some stack process outlived stop()", file=sys.stderr)

        figures = report(res, hops, args, flags, env_shown)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    finally:
        if args.state_dir is None:
            shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
