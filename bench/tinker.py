"""The Tinker API's cost: SDK step time against the same compute in-process, sampling through the
Tinker route against the OpenAI route, and save -> first sample latency, in one run.

    python bench/tinker.py [--model-train HuggingFaceTB/SmolLM2-135M-Instruct] [--model-sample tiny]
        [--steps 5] [--warmup 2] [--batch 8] [--seq-len 256] [--requests 64] [--concurrency 16]
        [--max-tokens 64] [--num-samples 1] [--bursts 3] [--rounds 20] [--threads N] [--quick]
        [--out bench/results/tinker.json] [--state-dir DIR]

  (a) step time: ``forward_backward`` + ``optim_step`` through the unmodified ``tinker`` SDK (both
      submitted, then both awaited, as the cookbook does) against the same calls on the session
      worker's compute core run here (``TrainingClients`` on the same folder, LoRA rank 32 on every
      target as the SDK's default, the same seed, batch, steps and AdamW parameters). That run
      comes first, in a child process of this script that has exited before the stack starts.
      Figure: in-process / SDK.
  (b) sampling: the same token-id prompts through ``SamplingClient.sample`` and through
      ``/v1/completions`` (the very vLLM request the Tinker route makes: ``completion_body``), the
      same number in flight; bursts alternate which route goes first. Figure: Tinker / OpenAI tok/s.
  (c) save -> first sample: per round one optimizer step, ``save_weights_for_sampler`` (T0 when its
      future resolves), ``create_sampling_client(model_path=...)``, one ``sample`` (T1). Baseline: a
      second sample on the now loaded adapter. Target p50 of T1 - T0 < 0.5 s.

Stacks are ``LocalStack`` with the local launcher (as the Tinker tests start them); a NATS tap of
this process times each call's hops. Targets are reported, not enforced: it always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODELS_DIR = REPO / ".loopline" / "models"
# From this folder, before it leaves sys.path: this file is named like the SDK, and with its folder
# first on sys.path ``import tinker`` would import it instead of the SDK.
from serving_paths import CpuMeter  # noqa: E402
from tinker_parts import (  # noqa: E402
    ADAM,
    RANK,
    SEED,
    Tap,
    peak_rss_gb,
    prompt_ids,
    report,
    sdk_data,
    stack_roles,
    token_rows,
    with_stack,
)

sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

QUICK = {"steps": 2, "warmup": 1, "batch": 2, "seq_len": 64, "requests": 16, "concurrency": 8,
         "max_tokens": 16, "bursts": 1, "rounds": 3}


# --- (a) in-process ------------------------------------------------------------------------------
def in_process(path: str, rows, steps: int, warmup: int) -> dict:
    import numpy as np
    from tinker import types as tt

    from loopline.common.contracts.tinker_schemas import LoraSpec
    from loopline.tinker_worker.training import TrainingClients

    meter = CpuMeter({"this process": [(os.getpid(), False)]})
    clients = TrainingClients(path)
    clients.create("bench", LoraSpec(rank=RANK, seed=SEED))
    data = [tt.Datum(model_input=tt.ModelInput.from_ints(x),
                     loss_fn_inputs={"target_tokens": np.asarray(y, np.int64),
                                     "weights": np.asarray(w, np.float32)}) for x, y, w in rows]
    out = {"step_s": [], "fb_s": [], "loss": []}
    # Invariant: out holds the timed steps among the first i; every step ran fb then optim.
    for i in range(warmup + steps):
        if i == warmup:
            meter.start("timed")
        t0 = time.perf_counter()
        result = clients.forward_backward("bench", data, "cross_entropy", None, False)
        t1 = time.perf_counter()
        clients.optim_step("bench", tt.AdamParams(**ADAM))
        t2 = time.perf_counter()
        out["loss"].append(result.metrics["loss:sum"])
        if i >= warmup:
            out["step_s"].append(t2 - t0)
            out["fb_s"].append(t1 - t0)
        print(f"  in-process step {i + 1}/{warmup + steps}: {(t2 - t0) * 1000:.0f} ms", flush=True)
    meter.stop("timed")
    out["other_share"] = meter.other_share()["timed"]
    out["cpu_per_step"] = {r: v / steps for r, v in meter.passes["timed"]["cpu_s"].items()}
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return out


# --- (a) through the SDK -------------------------------------------------------------------------
async def sdk_steps(service, stack, base: str, rows, steps: int, warmup: int) -> dict:
    from tinker import types as tt

    client = await service.create_lora_training_client(base_model=base, rank=RANK, seed=SEED)
    data = sdk_data(rows)
    tap = Tap(stack.nats_url)
    await tap.open()
    meter = CpuMeter(stack_roles(stack))
    out = {"step_s": [], "loss": [], "hops": []}
    try:
        # Invariant: out holds the timed steps among the first i, each awaited before the next.
        for i in range(warmup + steps):
            if i == warmup:
                meter.start("timed")
            sent, t0 = time.time(), time.perf_counter()
            fb = client.forward_backward(data, "cross_entropy")  # both sent, then both awaited
            opt = client.optim_step(tt.AdamParams(**ADAM))
            result = await fb
            fb_got = time.time()
            await opt
            t1, opt_got = time.perf_counter(), time.time()
            out["loss"].append(result.metrics["loss:sum"])
            print(f"  SDK step {i + 1}/{warmup + steps}: {(t1 - t0) * 1000:.0f} ms", flush=True)
            if i < warmup:
                continue
            out["step_s"].append(t1 - t0)
            await asyncio.sleep(0.05)  # the tap's last callbacks
            fb_call, opt_call = tap.call("forward_backward", sent), tap.call("optim_step", sent)
            if fb_call and opt_call and fb_call[1] in tap.futures and opt_call[1] in tap.futures:
                fb_done, opt_done = tap.futures[fb_call[1]], tap.futures[opt_call[1]]
                out["hops"].append({"submit -> forward_backward call on NATS": fb_call[0] - sent,
                                    "call on NATS -> its result stored (worker)": fb_done - fb_call[0],
                                    "result stored -> SDK has it": fb_got - fb_done,
                                    "submit -> optim_step call on NATS": opt_call[0] - sent,
                                    "fb result stored -> optim result stored": opt_done - fb_done,
                                    "optim result stored -> SDK has it": opt_got - opt_done})
        meter.stop("timed")
    finally:
        await tap.close()
    out["cpu_per_step"] = {r: v / steps for r, v in meter.passes["timed"]["cpu_s"].items()}
    out["other_share"] = meter.other_share()["timed"]
    workers = [pid for pid, _ in meter.roles["session worker"]]
    out["peak_rss_gb"] = max((peak_rss_gb(pid) for pid in workers), default=float("nan"))
    return out


# --- (b) sampling, two routes --------------------------------------------------------------------
async def sampling(service, stack, base: str, prompts: list[list[int]], args) -> dict:
    import aiohttp
    from tinker import types as tt

    from loopline.gateway.tinker.sampling import completion_body

    sampler = await service.create_sampling_client(base_model=base)
    gate = asyncio.Semaphore(args.concurrency)
    params = [tt.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=SEED + i)
              for i in range(len(prompts))]

    async def via_tinker(i: int) -> list[list[int]]:
        async with gate:
            r = await sampler.sample(prompt=tt.ModelInput.from_ints(prompts[i]),
                                     num_samples=args.num_samples, sampling_params=params[i])
        return [list(s.tokens) for s in r.sequences]

    async def via_openai(i: int) -> list[list[int]]:
        request = tt.SampleRequest(prompt=tt.ModelInput.from_ints(prompts[i]),
                                   num_samples=args.num_samples, sampling_params=params[i])
        body = completion_body(request, stack.default_model)
        async with gate, http.post("/v1/completions", json=body) as r:
            r.raise_for_status()
            body = await r.json()
        return [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]

    routes = {"tinker": via_tinker, "openai": via_openai}
    meter = CpuMeter(stack_roles(stack))
    res = {k: {"wall_s": [], "tokens": [], "seqs": None} for k in routes}
    async with aiohttp.ClientSession(base_url=stack.url, timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=args.concurrency)) as http:
        # Warm-up, a whole burst each: connections, vLLM's first batches of every prompt length (a
        # first burst of a few prompts left the route that went first measured 4x slower).
        for fn in routes.values():
            await asyncio.gather(*(fn(i) for i in range(len(prompts))))
        # Invariant: bursts 0..b-1 ran through both routes, who goes first flipping each burst.
        for b in range(args.bursts):
            for key in (("tinker", "openai") if b % 2 == 0 else ("openai", "tinker")):
                await asyncio.sleep(0.2)
                meter.start(key)
                t0 = time.perf_counter()
                seqs = await asyncio.gather(*(routes[key](i) for i in range(len(prompts))))
                res[key]["wall_s"].append(time.perf_counter() - t0)
                meter.stop(key)
                res[key]["tokens"].append(sum(len(s) for r in seqs for s in r))
                res[key]["seqs"] = res[key]["seqs"] or seqs
                tps = res[key]["tokens"][-1] / res[key]["wall_s"][-1]
                print(f"  burst {b + 1}/{args.bursts} {key:<7} {tps:8.1f} tok/s", flush=True)
    tok_s = {k: [t / w for t, w in zip(v["tokens"], v["wall_s"], strict=True)] for k, v in res.items()}
    return {"ratios": [t / o for t, o in zip(tok_s["tinker"], tok_s["openai"], strict=True)],
            "same_tokens": res["tinker"]["seqs"] == res["openai"]["seqs"],
            "tok_s": {k: statistics.median(v) for k, v in tok_s.items()},
            "cpu_per_burst": {k: {r: v / p["turns"] for r, v in p["cpu_s"].items()}
                              for k, p in meter.passes.items()},
            "other_share": meter.other_share(),
            "raw": {k: {f: v[f] for f in ("wall_s", "tokens")} for k, v in res.items()}}


# --- (c) save -> first sample --------------------------------------------------------------------
async def save_to_sample(service, stack, base: str, vocab: int, rounds: int) -> list[dict]:
    from tinker import types as tt

    from loopline.common.contracts.tinker_names import sampler_hash

    client = await service.create_lora_training_client(base_model=base, rank=RANK, seed=SEED)
    data = sdk_data(token_rows(vocab, 4, 32, SEED))
    prompt = tt.ModelInput.from_ints(token_rows(vocab, 1, 16, SEED + 1)[0][0])
    params = tt.SamplingParams(max_tokens=16, temperature=1.0, seed=SEED)
    tap = Tap(stack.nats_url)
    await tap.open()
    rows = []
    try:
        # Invariant: rows holds rounds 1..i-1 (round 0 warms up), each a step, a save, two samples.
        for i in range(rounds + 1):
            fb = client.forward_backward(data, "cross_entropy")
            opt = client.optim_step(tt.AdamParams(**ADAM))
            await fb
            await opt
            name = f"bench-{i}"
            started = time.time()
            saved = await client.save_weights_for_sampler(name)
            t0 = time.time()
            sampler = await service.create_sampling_client(model_path=saved.path)
            created = time.time()
            await sampler.sample(prompt=prompt, num_samples=1, sampling_params=params)
            t1 = time.time()
            await sampler.sample(prompt=prompt, num_samples=1, sampling_params=params)
            t2 = time.time()
            await asyncio.sleep(0.05)  # the tap's last callbacks
            job = sampler_hash(client.model_id, name)
            row = {"save_call": started, "resolved": t0, "client_created": created, "first_sample": t1,
                   "ordinary_sample_s": t2 - t1, "written": tap.written.get(saved.path),
                   "announced": tap.announced.get(job), "loaded": tap.loaded.get(job)}
            print(f"  round {i}: resolved -> first sample {t1 - t0:.3f} s, save call -> first sample "
                  f"{t1 - started:.3f} s, ordinary sample {t2 - t1:.3f} s", flush=True)
            if i > 0:
                rows.append(row)
    finally:
        await tap.close()
    return rows


def in_child(out: Path) -> dict:
    """(a)'s in-process run in a child process of this script, with the same flags. Its memory is
    the system's again before the stack starts: freeing the model in this process left 4.8 GB
    resident here (the allocator keeps what 8 x 256 tokens on SmolLM2 took), and beside the
    session worker's own 6 GB that ran a busy machine out of memory."""
    subprocess.run([sys.executable, __file__, *sys.argv[1:], "--in-process-only", str(out)], check=True)
    return json.loads(out.read_text())


# --- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-train", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                        help="(a)'s model: what resolve_model takes (tiny, a HF id, a folder)")
    parser.add_argument("--model-sample", default="tiny", help="(b) and (c)'s model")
    parser.add_argument("--steps", type=int, default=5, help="(a) timed steps, each side")
    parser.add_argument("--warmup", type=int, default=2, help="(a) untimed steps first, each side")
    parser.add_argument("--batch", type=int, default=8, help="(a) sequences per forward_backward")
    parser.add_argument("--seq-len", type=int, default=256, help="(a) tokens per sequence")
    parser.add_argument("--requests", type=int, default=64, help="(b) prompts per burst")
    parser.add_argument("--concurrency", type=int, default=16, help="(b) requests in flight")
    parser.add_argument("--max-tokens", type=int, default=64, help="(b) tokens per sample")
    parser.add_argument("--num-samples", type=int, default=1, help="(b) samples per request (n)")
    parser.add_argument("--bursts", type=int, default=3, help="(b) bursts per route, alternating")
    parser.add_argument("--rounds", type=int, default=20, help="(c) save -> sample rounds")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                        help="torch threads in-process and OMP_NUM_THREADS for the stack (its session "
                             "worker), so both sides compute alike (default: CPUs - 1)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run; its defaults (flags given beside it win): " + json.dumps(QUICK))
    parser.add_argument("--out", type=Path, default=Path("bench/results/tinker.json"))
    parser.add_argument("--state-dir", type=Path, default=None, help="stacks' state (default: a temp dir)")
    parser.add_argument("--in-process-only", type=Path, default=None, help=argparse.SUPPRESS)
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(**QUICK)  # flags given beside it still win
    return parser.parse_args()


def main() -> int:
    args = parse_args()

    # Before torch loads here and before the stack (whose session worker inherits it) starts.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TINKER_TELEMETRY"] = "0"
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from loopline.ml.models.resolve import resolve_model

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # no load progress bars between the figures
    transformers.utils.logging.disable_progress_bar()
    args.train_path = str(resolve_model(args.model_train, MODELS_DIR))
    args.sample_path = str(resolve_model(args.model_sample, MODELS_DIR))
    train_vocab = AutoConfig.from_pretrained(args.train_path).vocab_size
    train_rows = token_rows(train_vocab, args.batch, args.seq_len, SEED)
    if args.in_process_only:  # the child of in_child
        args.in_process_only.write_text(json.dumps(in_process(args.train_path, train_rows, args.steps,
                                                              args.warmup)))
        return 0
    sample_vocab = AutoConfig.from_pretrained(args.sample_path).vocab_size
    special = set(AutoTokenizer.from_pretrained(args.sample_path).all_special_ids)
    prompts = prompt_ids(sample_vocab, special, args.requests)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="loopline-bench-tinker-"))
    started = time.perf_counter()
    results: dict = {}

    async def train_work(service, stack) -> dict:
        print("(a) through the SDK", flush=True)
        results["a"] = await sdk_steps(service, stack, args.train_path, train_rows, args.steps, args.warmup)
        if args.sample_path == args.train_path:
            await sample_work(service, stack)
        return results

    async def sample_work(service, stack) -> dict:
        print("(b) sampling: Tinker route and OpenAI route", flush=True)
        results["b"] = await sampling(service, stack, args.sample_path, prompts, args)
        print("(c) save -> first sample", flush=True)
        results["c"] = await save_to_sample(service, stack, args.sample_path, sample_vocab, args.rounds)
        return results

    try:
        print(f"(a) in-process (a child process): TrainingClients on {args.train_path}", flush=True)
        state.mkdir(parents=True, exist_ok=True)
        a_in = in_child(state / "in-process.json")
        with_stack(state / "train", args.train_path, train_work, MODELS_DIR)
        if args.sample_path != args.train_path:
            with_stack(state / "sample", args.sample_path, sample_work, MODELS_DIR)
        figures = report(args, a_in, results["a"], results["b"], results["c"])
        figures["wall_s"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2, default=str) + "\n")
        print(f"wrote {args.out} ({figures['wall_s']:.0f} s)")
    finally:
        if args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
