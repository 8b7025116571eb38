"""What ``tinker.py`` measures with: its settings, the data it trains on, the NATS tap that times a
call's hops through the platform, the processes whose CPU it counts, the stacks it starts, and its
report.

``tinker.py`` imports this module while its folder is still on ``sys.path``, then takes the folder
off: it shares the SDK's name, and ``import tinker`` must find the SDK (here too).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from serving_paths import percentile

TARGET_STEP_RATIO = 0.9  # (a) in-process / SDK step time
TARGET_SAVE_P50_S = 0.5  # (c) save resolved -> first sample, p50
RANK = 32  # the SDK's default LoRA rank (create_lora_training_client), every target on
SEED = 1234
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.01,
        "grad_clip_norm": 1.0}
# Session workers as local processes, as the Tinker tests start them, but the trainer reconciling at
# its default interval (2 s), not the tests' 0.25 s: each pass lists the TINKER_WORKERS bucket with
# nats-py's kv.keys(), whose ephemeral consumer outlives it by 5 minutes, and at 4 passes a second
# the bucket reaches NATS's 1000-consumer limit after about 4 minutes (measured: 76, 195, 313, 432
# consumers at 0, 30, 60, 90 s), after which every pass fails.
STACK_ENV = {"LOOPLINE_LAUNCHER": "local"}
# Above this share of the CPUs used by other processes, the figures are flagged as indicative.
NOISY_SHARE = 0.10


def stats(xs: list[float], scale: float = 1000.0) -> dict:
    """Summary of ``xs`` (seconds) in ms by default."""
    xs = [x * scale for x in xs]
    return {"mean": statistics.fmean(xs) if xs else float("nan"), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "min": min(xs, default=float("nan")),
            "max": max(xs, default=float("nan")), "n": len(xs)}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# --- data ----------------------------------------------------------------------------------------
Row = tuple[list[int], list[int], list[float]]  # a datum: input ids, target ids, weights


def token_rows(vocab: int, count: int, length: int, seed: int) -> list[Row]:
    """``count`` sequences of ``length`` random ids, the first quarter a prompt (weight 0). A step's
    cost depends on the shape only, so random ids cost what text would."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    # Invariant: rows holds the first len(rows) sequences, each drawn from one generator in order.
    for _ in range(count):
        ids = rng.integers(3, vocab, length + 1).tolist()
        rows.append((ids[:-1], ids[1:], [0.0] * (length // 4) + [1.0] * (length - length // 4)))
    return rows


def prompt_ids(vocab: int, special: set[int], count: int) -> list[list[int]]:
    """``count`` token-id prompts of 16 to 128 ids, none of them a special token (an EOS in the
    prompt would be sent as text both ways, but reads oddly in a trace)."""
    return [[t for t in token_rows(vocab, 1, 16 + (i * 97) % 113, SEED + i)[0][0] if t not in special]
            for i in range(count)]


def sdk_data(rows: list[Row]) -> list:
    from tinker import types as tt

    return [tt.Datum(model_input=tt.ModelInput.from_ints(x),
                     loss_fn_inputs={"target_tokens": y, "weights": w}) for x, y, w in rows]


# --- the tap: when each call and result crossed NATS ---------------------------------------------
class Tap:
    """Core NATS subscriptions of this process, timing what crosses the bus: the gateway's Tinker
    calls to a session worker, the worker's stored results, the checkpoint-watcher's announces, the
    replicas' loaded events and the worker's saved events (those two carry their sender's time).

    Receive times are this process's ``time.time()`` when its event loop runs the callback; the
    loop is idle while the bench awaits the SDK, so on a quiet machine that is within a millisecond
    of the message's arrival (on a busy one, scheduling delays show up here too)."""

    def __init__(self, nats_url: str):
        self.url, self.nc = nats_url, None
        self.calls: list[tuple[float, str, str]] = []  # (time, kind, request id) of each StepCall
        self.futures: dict[str, float] = {}  # request id -> when its result was stored
        self.announced: dict[str, float] = {}  # adapter hash -> the watcher's announce
        self.loaded: dict[str, float] = {}  # adapter hash -> a replica's loaded event time
        self.written: dict[str, float] = {}  # tinker path -> the worker's "saved" event time

    async def open(self) -> None:
        import nats

        self.nc = await nats.connect(self.url, name="bench-tinker-tap")

        async def on(subject: str, handle) -> None:
            async def cb(msg) -> None:
                if not msg.subject.endswith(".request"):  # a sample's kept request, not a result
                    handle(time.time(), json.loads(msg.data))
            await self.nc.subscribe(subject, cb=cb)

        await on("tinker.calls.>", lambda t, d: self.calls.append((t, d["kind"], d["request_id"])))
        await on("tinker.futures.>", lambda t, d: self.futures.setdefault(d["request_id"], t))
        await on("checkpoints.>", lambda t, d: self.announced.setdefault(d["job_hash"], t))
        await on("events.adapters.*.loaded", lambda t, d: self.loaded.setdefault(d["job_hash"], d["time"]))
        await on("events.sessions.*.saved", lambda t, d: self.written.setdefault(d["path"], d["time"]))
        await self.nc.flush()

    def call(self, kind: str, after: float) -> tuple[float, str] | None:
        """The first ``kind`` call seen at or after ``after``: (time, request id)."""
        found = [(t, rid) for t, k, rid in self.calls if k == kind and t >= after]
        return found[0] if found else None

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


def stack_roles(stack) -> dict:
    """CpuMeter roles of a running stack; the session workers are the trainer's launched children."""
    import psutil

    workers = [p.pid for p in psutil.Process(stack.trainer.pid).children(recursive=True)
               if "loopline.tinker_worker" in " ".join(p.cmdline())]
    return {"client (this process)": [(os.getpid(), False)], "gateway": [(stack.gateway.pid, True)],
            "nats-server": [(stack.nats.pid, True)], "queue": [(stack.queue.pid, True)],
            "trainer, checkpoint-watcher": [(stack.trainer.pid, False), (stack.checkpoint_watcher.pid, True)],
            "session worker": [(pid, True) for pid in workers],
            "replica (+ engine)": [(p.pid, True) for p in stack.inference.values()]}


def peak_rss_gb(pid: int) -> float:
    """The most memory ``pid`` has held resident (its VmHWM), in GiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


# --- stacks --------------------------------------------------------------------------------------
def with_stack(state_dir: Path, model: str, work, models_dir: Path) -> dict:
    """Start a stack serving ``model``, run ``work(service, stack)`` (a coroutine function), stop."""
    import tinker

    from loopline.common.local.stack import LocalStack

    stack = LocalStack(state_dir, model, replicas=1, env=STACK_ENV, models_dir=models_dir)
    print(f"  starting LocalStack ({Path(model).name}) in {state_dir}", flush=True)
    started = time.perf_counter()
    stack.start()
    # Stopped whatever happens: a stack left running (its state folder then removed under it) spins
    # its session worker and nats-server at half a core each.
    try:
        print(f"  stack up in {time.perf_counter() - started:.0f} s at {stack.url}", flush=True)
        service = tinker.ServiceClient(base_url=stack.url, api_key="tml-bench")
        try:
            return asyncio.run(work(service, stack))
        finally:
            service.close("success").result(timeout=30)
    finally:
        stack.stop()


# --- report --------------------------------------------------------------------------------------
SAVE_PARTS = {  # (c)'s breakdown: from which mark to which, per round
    "save call -> files written (worker)": ("save_call", "written"),
    "written -> announced (checkpoint-watcher)": ("written", "announced"),
    "announced -> save future resolved at the SDK": ("announced", "resolved"),
    "announced -> a replica loaded it": ("announced", "loaded"),
    "resolved -> sampling client created": ("resolved", "client_created"),
    "sampling client created -> first sample back": ("client_created", "first_sample"),
}


def report_a(args, a_in: dict, a_sdk: dict) -> dict:
    base, sdk = stats(a_in["step_s"]), stats(a_sdk["step_s"])
    diffs = [abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a_in["loss"], a_sdk["loss"], strict=True)]
    print(f"\n(a) step time — {Path(args.train_path).name}, {args.batch} x {args.seq_len} tokens, LoRA "
          f"r{RANK} all targets, AdamW {ADAM}, {args.steps} timed steps after {args.warmup} warm-up, "
          f"torch threads {args.threads}")
    row = "    {:<48}{:>12}{:>12}"
    print(row.format("", "in-process", "SDK"))
    for k in ("mean", "p50", "min", "max"):
        print(row.format(f"step, ms ({k})", f"{base[k]:.1f}", f"{sdk[k]:.1f}"))
    print(row.format("forward_backward alone, ms (p50)", f"{stats(a_in['fb_s'])['p50']:.1f}", ""))
    own_cpu = a_in["cpu_per_step"]["this process"]
    worker_cpu = a_sdk["cpu_per_step"].get("session worker", float("nan"))
    print(row.format("CPU s per step: the computing process", f"{own_cpu:.3f}", f"{worker_cpu:.3f}"))
    print(row.format("CPU s per step: every process of the run", f"{own_cpu:.3f}",
                     f"{sum(a_sdk['cpu_per_step'].values()):.3f}"))
    print(row.format("peak resident memory of that process, GiB", f"{a_in['peak_rss_gb']:.2f}",
                     f"{a_sdk['peak_rss_gb']:.2f}"))
    print(row.format("other processes' share of the CPUs", f"{a_in['other_share']:.0%}",
                     f"{a_sdk['other_share']:.0%}"))
    print(f"    losses equal step by step (same seed and data): max relative difference {max(diffs):.1e}")
    hops = {k: stats([h[k] for h in a_sdk["hops"]]) for k in (a_sdk["hops"][0] if a_sdk["hops"] else {})}
    if hops:
        print(f"    where an SDK step's time goes (over {len(a_sdk['hops'])} steps, ms; the tap's clock):")
        for k, s in hops.items():
            print(f"      {k:<52}p50 {s['p50']:9.1f}  p90 {s['p90']:9.1f}")
    print("    CPU s per SDK step by process: "
          + ", ".join(f"{r} {v:.3f}" for r, v in a_sdk["cpu_per_step"].items()))
    return {"ratio_p50": base["p50"] / sdk["p50"], "ratio_mean": base["mean"] / sdk["mean"],
            "in_process_ms": base, "sdk_ms": sdk, "loss_max_rel_diff": max(diffs), "hops_ms": hops,
            "in_process": a_in, "sdk": a_sdk}


def report_b(args, b: dict) -> dict:
    tok = b["tok_s"]
    print(f"\n(b) sampling — {Path(args.sample_path).name}, {args.requests} token-id prompts of "
          f"{args.num_samples} sample(s), {args.concurrency} in flight, max_tokens {args.max_tokens}, "
          "temperature 1, seeded, "
          f"{args.bursts} burst(s) per route after a warm-up burst each")
    print(f"    tok/s (median burst): Tinker route {tok['tinker']:.1f}, OpenAI route {tok['openai']:.1f}; "
          f"the same tokens both ways: {b['same_tokens']}")
    for key, cpu in b["cpu_per_burst"].items():
        print(f"    CPU s per burst, {key}: " + ", ".join(f"{r} {v:.2f}" for r, v in cpu.items()))
    return {"ratio_median": statistics.median(b["ratios"]), **b}


def report_c(args, c: list[dict]) -> dict:
    figures = {"resolved_to_first_ms": stats([r["first_sample"] - r["resolved"] for r in c]),
               "call_to_first_ms": stats([r["first_sample"] - r["save_call"] for r in c]),
               "ordinary_sample_ms": stats([r["ordinary_sample_s"] for r in c]),
               "parts_ms": {k: stats([r[y] - r[x] for r in c if r[x] and r[y]])
                            for k, (x, y) in SAVE_PARTS.items()},
               "rounds": c}
    first, call = figures["resolved_to_first_ms"], figures["call_to_first_ms"]
    plain = figures["ordinary_sample_ms"]
    print(f"\n(c) save -> first sample — {Path(args.sample_path).name}, {len(c)} rounds (after one warm-up "
          "round)")
    print(f"    save future resolved -> first sample: p50 {first['p50']:.0f} ms, p90 {first['p90']:.0f} ms")
    print(f"    save call -> first sample:            p50 {call['p50']:.0f} ms, p90 {call['p90']:.0f} ms")
    print(f"    baseline, a sample on the loaded adapter: p50 {plain['p50']:.0f} ms, "
          f"p90 {plain['p90']:.0f} ms")
    for k, s in figures["parts_ms"].items():
        print(f"      {k:<52}p50 {s['p50']:7.1f}  p90 {s['p90']:7.1f} ms")
    return figures


def report(args, a_in: dict, a_sdk: dict, b: dict, c: list[dict]) -> dict:
    a, b, c = report_a(args, a_in, a_sdk), report_b(args, b), report_c(args, c)
    busy = max([a_in["other_share"], a_sdk["other_share"], *b["other_share"].values()])
    first, call, plain = c["resolved_to_first_ms"], c["call_to_first_ms"], c["ordinary_sample_ms"]
    print("\n" + "=" * 100)
    print("SUMMARY (bench/tinker.py)")
    print(f"  (a) step time in-process / SDK = {a['ratio_p50']:.3f} (median steps "
          f"{a['in_process_ms']['p50']:.0f} / {a['sdk_ms']['p50']:.0f} ms; of the means "
          f"{a['ratio_mean']:.3f})  target >= {TARGET_STEP_RATIO}  "
          f"{verdict(a['ratio_p50'] >= TARGET_STEP_RATIO)}")
    print(f"  (b) sampling Tinker / OpenAI tok/s = {b['ratio_median']:.3f} (median of bursts "
          + ", ".join(f"{x:.3f}" for x in b["ratios"]) + f"; {b['tok_s']['tinker']:.0f} vs "
          f"{b['tok_s']['openai']:.0f} tok/s)")
    print(f"  (c) save resolved -> first sample p50 {first['p50'] / 1000:.3f} s, p90 "
          f"{first['p90'] / 1000:.3f} s  target p50 < {TARGET_SAVE_P50_S} s  "
          f"{verdict(first['p50'] / 1000 < TARGET_SAVE_P50_S)}; from the save call p50 "
          f"{call['p50'] / 1000:.3f} s; "
          f"a sample on a loaded adapter p50 {plain['p50'] / 1000:.3f} s")
    if busy > NOISY_SHARE:
        print(f"  WARNING: other processes used up to {busy:.0%} of the CPUs during a timed pass: the "
              "figures are indicative only; rerun on a quiet machine")
    print("=" * 100)
    return {"args": {k: v for k, v in vars(args).items() if k not in ("out", "state_dir")},
            "targets": {"step_ratio": TARGET_STEP_RATIO, "save_p50_s": TARGET_SAVE_P50_S},
            "a": a, "b": b, "c": c, "max_other_share": busy, "cpus": os.cpu_count(),
            "loadavg": os.getloadavg()}
