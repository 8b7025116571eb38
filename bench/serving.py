"""Serving overhead: the same prompts through the engine in-process and through the whole platform.

    python bench/serving.py [--model tiny] [--prompts 64] [--max-tokens 32] [--out bench/results/serving.json]

One run measures, on the same deterministic prompts (greedy, same ``max_tokens``):

  (a) baseline: ``VllmEngine`` called in this process, with the settings the inference service uses
      and its ``PromptBuilder`` tokenization;
  (b) platform: HTTP -> gateway -> NATS JetStream -> inference replica -> NATS -> gateway -> HTTP,
      started with ``LocalStack`` exactly as ``make up`` does.

For each path: throughput (every prompt at once), latency (one request at a time) and time to first
token (one streaming request at a time). It prints b against a and PASS/MISS next to each target,
and for (b) where the time of a request goes, hop by hop, from the timestamps the messages carry
(``WorkItem.submitted_at``, ``ResultItem.started_at``/``finished_at``) and from a NATS subscriber of
its own. The two paths run one after the other, never together, so they do not share the CPUs.
It always exits 0: the targets are reported, not enforced.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The OpenMP default the inference service applies (loopline/inference/__main__.py), set before torch
# is imported, so both paths run the engine alike.
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) - 2)))

# Targets of the platform against the in-process engine.
TARGET_THROUGHPUT_RATIO = 0.95
TARGET_ADDED_P50_MS = 5.0

WARMUP_SEQUENTIAL = 4
# Settings that change CPU inference speed a lot; printed with the figures.
ENV_SHOWN = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
# Above this share of the machine's CPUs used by other processes during a pass, say the run is noisy.
NOISY_SHARE = 0.10
MAX_NUM_SEQS = 64  # InferenceSettings.max_inflight, which the service passes as max_num_seqs
DTYPE = "auto"

_WORDS = (
    "the a of to in on for with and or but not is are was be have do will can this that it they "
    "we you model token text data train step loss answer question user prompt reply small large "
    "fast slow time day city river mountain water fire red green blue one two three ten hundred "
    "queue worker result engine batch stream gateway latency request cache memory"
).split()


# --- prompts -----------------------------------------------------------------------------------------
def make_prompts(count: int, seed: int) -> list[str]:
    """``count`` deterministic prompts whose lengths spread from a few words to a few hundred."""
    rng = random.Random(seed)
    lengths = [4 + (i * 300) // max(count - 1, 1) for i in range(count)]
    rng.shuffle(lengths)
    prompts = []
    for i, n in enumerate(lengths):
        words = " ".join(rng.choice(_WORDS) for _ in range(n))
        prompts.append(f"Request {i}: {words}. Answer:")
    return prompts


# --- statistics ----------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else float("nan"),
            "min": min(values, default=float("nan")), "max": max(values, default=float("nan"))}


class CpuMeter:
    """CPU seconds each role's processes spent during a pass, and what the rest of the machine spent.

    The machine has few cores and others may use them: the "other" column says how quiet it was.
    """

    def __init__(self, roles: dict[str, tuple[int, bool]]):
        # role -> (pid, count its descendants too)
        self.roles = roles
        try:
            import psutil  # noqa: F401 - comes with vLLM; without it the CPU table is left out
        except ImportError:
            self.roles = {}
        self.marks: dict[str, tuple[float, dict[str, float], float]] = {}
        self.passes: dict[str, dict] = {}

    @staticmethod
    def _cpu(pid: int, recursive: bool) -> float:
        import psutil

        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)] if recursive else [proc]
        except psutil.Error:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    @staticmethod
    def _machine_busy() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(v for k, v in t._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))

    def start(self, name: str) -> None:
        cpu = {r: self._cpu(pid, rec) for r, (pid, rec) in self.roles.items()}
        self.marks[name] = (time.perf_counter(), cpu, self._machine_busy() if self.roles else 0.0)

    def stop(self, name: str) -> None:
        wall0, cpu0, busy0 = self.marks.pop(name)
        wall = time.perf_counter() - wall0
        cpu = {r: self._cpu(pid, rec) - cpu0[r] for r, (pid, rec) in self.roles.items()}
        busy = self._machine_busy() - busy0 if self.roles else 0.0
        self.passes[name] = {"wall_s": wall, "cpu_s": cpu, "other_cpu_s": max(busy - sum(cpu.values()), 0.0),
                             "machine_cpu_s": busy}


@dataclass
class PathResult:
    """What one path measured; times in seconds, per prompt index where it is a list."""

    throughput_wall_s: float = 0.0
    throughput_tokens: int = 0
    throughput_tokens_per_prompt: list[int] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    latency_tokens: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    stream_total_s: list[float] = field(default_factory=list)
    stream_tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    startup_s: float = 0.0
    cpu: dict = field(default_factory=dict)
    burst_hops: list[dict] = field(default_factory=list)  # (b) only: the throughput pass's Hops

    @property
    def tok_per_s(self) -> float:
        return self.throughput_tokens / self.throughput_wall_s if self.throughput_wall_s else 0.0


# --- (a) the engine in-process ------------------------------------------------------------------------------
async def bench_engine(model_path: str, model_name: str, prompts: list[str], warmup: list[str],
                       max_tokens: int, adapters: bool) -> PathResult:
    from transformers import AutoTokenizer

    from loopline.common.schemas import SamplingParams, WorkItem
    from loopline.inference.prompts import PromptBuilder
    from loopline.common.settings import InferenceSettings
    from loopline.inference.engine import make_engine

    res = PathResult()
    t0 = time.perf_counter()
    # The service's own factory and adapter settings, so (a) runs the very engine a replica runs
    # (run-time adapters make vLLM set up its LoRA machinery, which costs base requests too).
    defaults = InferenceSettings()
    engine = make_engine("vllm", model_path, max_model_len=None, max_inflight=MAX_NUM_SEQS, dtype=DTYPE,
                         adapters=adapters, max_adapters=defaults.max_adapters,
                         max_adapter_rank=defaults.max_adapter_rank)
    await engine.start()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    builder = PromptBuilder(tokenizer, engine.info.max_model_len)
    res.startup_s = time.perf_counter() - t0
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def one(text: str, stream: bool = False) -> tuple[float, float, int, str]:
        """(total, ttft, tokens, text); tokenization counts, as the replica does it per request.
        ``stream`` as (b)'s requests: deltas only for the time-to-first-token pass."""
        start = time.perf_counter()
        rid = uuid.uuid4().hex
        item = WorkItem(request_id=rid, group=rid, index=0, model=model_name, prompt=text,
                        sampling=sampling, stream=stream)
        request = builder.build(item)
        first = None
        tokens = 0
        out = []
        async for delta in engine.generate(request):
            if first is None and delta.text:
                first = time.perf_counter() - start
            tokens = delta.tokens
            out.append(delta.text)
        return time.perf_counter() - start, first if first is not None else float("nan"), tokens, "".join(out)

    # AsyncLLM runs its engine core in a child process whatever VLLM_ENABLE_V1_MULTIPROCESSING says.
    meter = CpuMeter({"frontend (this process)": (os.getpid(), False), "engine core": (-1, True)})
    try:
        for text in warmup[:WARMUP_SEQUENTIAL]:
            await one(text)
        await asyncio.gather(*(one(t) for t in warmup))
        if meter.roles:
            meter.roles["engine core"] = (_child_pid(os.getpid()), True)

        meter.start("throughput")
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(t) for t in prompts))
        res.throughput_wall_s = time.perf_counter() - start
        meter.stop("throughput")
        res.throughput_tokens_per_prompt = [o[2] for o in outs]
        res.throughput_tokens = sum(res.throughput_tokens_per_prompt)
        res.texts = [o[3] for o in outs]

        meter.start("latency")
        for text in prompts:
            total, _ttft, tokens, _ = await one(text)
            res.latency_s.append(total)
            res.latency_tokens.append(tokens)
        meter.stop("latency")
        meter.start("ttft")
        for text in prompts:
            total, ttft, tokens, _ = await one(text, stream=True)
            res.ttft_s.append(ttft)
            res.stream_total_s.append(total)
            res.stream_tokens.append(tokens)
        meter.stop("ttft")
        res.cpu = meter.passes
    finally:
        await engine.stop()
        del engine
        gc.collect()
    return res


def _child_pid(pid: int) -> int:
    """The engine core process an AsyncLLM in ``pid`` started (it renames itself), or -1."""
    try:
        import psutil
    except ImportError:
        return -1

    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return -1
    for kid in kids:
        try:
            if "EngineCore" in " ".join(kid.cmdline()) or "EngineCore" in kid.name():
                return kid.pid
        except psutil.Error:
            pass
    return -1


# --- (b) HTTP -> gateway -> NATS -> inference ---------------------------------------------------------------
@dataclass
class Hops:
    """Timestamps (time.time()) of one non-streaming request, from the client and from NATS."""

    index: int = 0               # prompt index
    sent: float = 0.0            # client sends the POST
    submitted: float = 0.0       # gateway built the WorkItem (WorkItem.submitted_at)
    work_seen: float = 0.0       # the WorkItem reached a plain NATS subscriber
    started: float = 0.0         # replica began (ResultItem.started_at, before tokenization)
    finished: float = 0.0        # replica built the result (ResultItem.finished_at)
    result_seen: float = 0.0     # the result reached a plain NATS subscriber (≈ the gateway's)
    received: float = 0.0        # client has the whole response


class Tap:
    """Watches work items and results on core NATS to time each hop of a request."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.work: dict[str, tuple[float, float]] = {}      # group -> (submitted_at, seen)
        self.results: dict[str, tuple[float, float, float]] = {}  # group -> (started, finished, seen)
        self.nc = None

    async def open(self) -> None:
        import nats

        from loopline.common import subjects

        self.nc = await nats.connect(self.nats_url, name="bench-tap")

        async def on_work(msg) -> None:
            seen = time.time()
            item = json.loads(msg.data)
            self.work[item["group"]] = (item["submitted_at"], seen)

        async def on_result(msg) -> None:
            seen = time.time()
            item = json.loads(msg.data)
            self.results[item["group"]] = (item["started_at"], item["finished_at"], seen)

        await self.nc.subscribe(subjects.WORK_ALL, cb=on_work)
        await self.nc.subscribe(subjects.RESULTS_ALL, cb=on_result)
        await self.nc.flush()

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()

    def hops(self, index: int, group: str, sent: float, received: float) -> Hops | None:
        if group not in self.work or group not in self.results:
            return None
        submitted, work_seen = self.work[group]
        started, finished, result_seen = self.results[group]
        return Hops(index, sent, submitted, work_seen, started, finished, result_seen, received)


HOP_NAMES = [
    ("client -> gateway WorkItem", "sent", "submitted"),
    ("WorkItem -> NATS subscriber", "submitted", "work_seen"),
    ("NATS -> replica started", "work_seen", "started"),
    ("replica: tokenize+generate", "started", "finished"),
    ("result -> NATS subscriber", "finished", "result_seen"),
    ("NATS -> gateway -> client", "result_seen", "received"),
]


def platform_roles(stack) -> dict[str, tuple[int, bool]]:
    replica = next(iter(stack.inference.values()))
    return {
        "client (this process)": (os.getpid(), False),
        "gateway": (stack.gateway.pid, True),
        "nats-server": (stack.nats.pid, True),
        "queue": (stack.queue.pid, True),
        "replica (worker+AsyncLLM)": (replica.pid, False),
        "engine core": (_child_pid(replica.pid), True),
    }


async def bench_platform(stack_url: str, nats_url: str, model_name: str, prompts: list[str],
                         warmup: list[str], max_tokens: int,
                         roles: dict[str, tuple[int, bool]]) -> tuple[PathResult, list[Hops]]:
    import httpx

    res = PathResult()
    meter = CpuMeter(roles)
    hops: list[Hops] = []
    tap = Tap(nats_url)
    await tap.open()
    body = {"model": model_name, "max_tokens": max_tokens, "temperature": 0}
    # One single-connection client per concurrent request: one client with a 64-connection pool
    # spends most of its CPU in httpcore's pool bookkeeping, which walks every connection (with a
    # poll() on each idle socket) on every request and release — O(n²) per burst — and on 2 cores
    # that steals CPU from the very services being measured.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(base_url=stack_url, timeout=600, limits=limits) for _ in prompts]

    async with contextlib.AsyncExitStack() as exit_stack:
        for c in clients:
            await exit_stack.enter_async_context(c)

        async def one(text: str, slot: int = 0) -> tuple[float, int, str, str, float, float]:
            """A burst gives each request its own slot (connection); one at a time reuses slot 0."""
            client = clients[slot % len(clients)]
            sent = time.time()
            start = time.perf_counter()
            r = await client.post("/v1/completions", json={**body, "prompt": text})
            total = time.perf_counter() - start
            received = time.time()
            r.raise_for_status()
            data = r.json()
            group = data["id"].removeprefix("cmpl-")
            text_out = data["choices"][0]["text"]
            return total, data["usage"]["completion_tokens"], text_out, group, sent, received

        async def one_stream(text: str) -> tuple[float, float, int]:
            start = time.perf_counter()
            first = None
            tokens = 0
            payload = {**body, "prompt": text, "stream": True, "stream_options": {"include_usage": True}}
            async with clients[0].stream("POST", "/v1/completions", json=payload) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.perf_counter() - start
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return time.perf_counter() - start, first if first is not None else float("nan"), tokens

        try:
            for text in warmup[:WARMUP_SEQUENTIAL]:
                await one(text)
                await one_stream(text)
            await asyncio.gather(*(one(t, i) for i, t in enumerate(warmup)))

            meter.start("throughput")
            start = time.perf_counter()
            outs = await asyncio.gather(*(one(t, i) for i, t in enumerate(prompts)))
            res.throughput_wall_s = time.perf_counter() - start
            meter.stop("throughput")
            res.throughput_tokens_per_prompt = [o[1] for o in outs]
            res.throughput_tokens = sum(res.throughput_tokens_per_prompt)
            res.texts = [o[2] for o in outs]
            burst = [(i, o[3], o[4], o[5]) for i, o in enumerate(outs)]

            timed = []
            meter.start("latency")
            for i, text in enumerate(prompts):
                total, tokens, _text, group, sent, received = await one(text)
                res.latency_s.append(total)
                res.latency_tokens.append(tokens)
                timed.append((i, group, sent, received))
            meter.stop("latency")
            meter.start("ttft")
            for text in prompts:
                total, ttft, tokens = await one_stream(text)
                res.ttft_s.append(ttft)
                res.stream_total_s.append(total)
                res.stream_tokens.append(tokens)
            meter.stop("ttft")
            res.cpu = meter.passes
            # The tap's callbacks may run after the client already has its answer: look up last.
            await asyncio.sleep(0.2)
            hops = [h for h in (tap.hops(*t) for t in timed) if h is not None]
            res.burst_hops = [asdict(h) for h in (tap.hops(*t) for t in burst) if h is not None]
        finally:
            await tap.close()
    return res, hops


# --- report -----------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(a: PathResult, b: PathResult, hops: list[Hops], args, model_path: str) -> dict:
    ms = 1000.0
    added = [(lb - la) * ms for la, lb in zip(a.latency_s, b.latency_s)]
    added_ttft = [(tb - ta) * ms for ta, tb in zip(a.ttft_s, b.ttft_s)]
    ratio = b.tok_per_s / a.tok_per_s if a.tok_per_s else 0.0
    same_tokens = (a.throughput_tokens == b.throughput_tokens and a.latency_tokens == b.latency_tokens
                   and a.stream_tokens == b.stream_tokens)
    same_text = a.texts == b.texts
    added_p50 = percentile(added, 50)

    hop_stats = {}
    for name, x, y in HOP_NAMES:
        hop_stats[name] = summary([(getattr(h, y) - getattr(h, x)) * ms for h in hops])
    # What the replica spent against what the engine alone spent on the same prompt.
    replica_extra = [(h.finished - h.started) * ms - a.latency_s[h.index] * ms for h in hops]
    # The platform's own cost, from (b) alone: the client's wait minus the replica's tokenize+generate
    # window. Unlike b - a it does not compare two moments of a machine others may be using.
    outside = [(h.received - h.sent - (h.finished - h.started)) * ms for h in hops]

    n = len(a.latency_s)
    print()
    print(f"Loopline serving benchmark — model {args.model!r} ({model_path}), {n} prompts, "
          f"max_tokens {args.max_tokens}, greedy, run-time adapters {'on' if args.adapters else 'off'}")
    print(f"  (a) VllmEngine in-process      (b) HTTP -> gateway -> NATS -> inference replica")
    print("  " + " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in ENV_SHOWN))
    print()
    row = "{:<34}{:>14}{:>14}{:>14}"
    print(row.format("", "(a) engine", "(b) platform", "b - a / b/a"))
    print(row.format("throughput, tok/s", f"{a.tok_per_s:.1f}", f"{b.tok_per_s:.1f}", f"x{ratio:.3f}"))
    print(row.format("throughput wall, s", f"{a.throughput_wall_s:.3f}", f"{b.throughput_wall_s:.3f}",
                     f"{b.throughput_wall_s - a.throughput_wall_s:+.3f}"))
    print(row.format("generated tokens (throughput)", a.throughput_tokens, b.throughput_tokens,
                     "same" if a.throughput_tokens == b.throughput_tokens else "DIFFERENT"))
    for q in (50, 90, 99):
        la, lb = percentile(a.latency_s, q) * ms, percentile(b.latency_s, q) * ms
        print(row.format(f"latency p{q}, ms", f"{la:.2f}", f"{lb:.2f}", f"{lb - la:+.2f}"))
    for q in (50, 90, 99):
        print(row.format(f"added latency p{q} (per prompt), ms", "", "", f"{percentile(added, q):+.2f}"))
    for q in (50, 99):
        ta, tb = percentile(a.ttft_s, q) * ms, percentile(b.ttft_s, q) * ms
        print(row.format(f"TTFT p{q}, ms", f"{ta:.2f}", f"{tb:.2f}", f"{tb - ta:+.2f}"))
    print(row.format("added TTFT p50 (per prompt), ms", "", "", f"{percentile(added_ttft, 50):+.2f}"))
    print(row.format("startup, s", f"{a.startup_s:.1f}", f"{b.startup_s:.1f}", ""))
    print()
    print(f"  tokens equal on every pass: {same_tokens}   texts equal (throughput pass): {same_text}")
    print()
    print(f"  throughput b/a = {ratio:.3f}  (target >= {TARGET_THROUGHPUT_RATIO})  "
          f"{verdict(ratio >= TARGET_THROUGHPUT_RATIO)}")
    print(f"  added latency p50 = {added_p50:.2f} ms  (target <= {TARGET_ADDED_P50_MS} ms)  "
          f"{verdict(added_p50 <= TARGET_ADDED_P50_MS)}")
    print(f"  added latency p99 = {percentile(added, 99):.2f} ms")
    print(f"  TTFT p50 a = {percentile(a.ttft_s, 50) * ms:.2f} ms, "
          f"b = {percentile(b.ttft_s, 50) * ms:.2f} ms, added = {percentile(added_ttft, 50):.2f} ms")
    if outside:
        print(f"  (b) time outside the replica's generate window: p50 {percentile(outside, 50):.2f} ms, "
              f"p99 {percentile(outside, 99):.2f} ms  (the added latency without run-to-run noise)")
    if hops:
        print()
        print(f"  where a (b) request's time goes, sequential pass ({len(hops)} requests), ms:")
        hrow = "    {:<32}{:>9}{:>9}{:>9}"
        print(hrow.format("hop", "p50", "p90", "p99"))
        for name, st in hop_stats.items():
            print(hrow.format(name, f"{st['p50']:.2f}", f"{st['p90']:.2f}", f"{st['p99']:.2f}"))
        st = summary(replica_extra)
        print(hrow.format("replica generate - engine (a)", f"{st['p50']:.2f}", f"{st['p90']:.2f}",
                          f"{st['p99']:.2f}"))

    if b.burst_hops:
        bh = b.burst_hops
        t0 = min(h["sent"] for h in bh)
        last = lambda key: (max(h[key] for h in bh) - t0) * ms  # noqa: E731
        print()
        first = lambda key: (min(h[key] for h in bh) - t0) * ms  # noqa: E731
        span = lambda key: f"{first(key):.0f}..{last(key):.0f}"  # noqa: E731
        print("  throughput pass of (b), ms after the first POST was sent: "
              f"last POST sent {last('sent'):.0f}, "
              f"WorkItems built {span('submitted')}, started by the replica {span('started')}, "
              f"results built {span('finished')}, last response received {last('received'):.0f}")
        print(f"  (a) did the whole pass in {a.throughput_wall_s * ms:.0f} ms")

    for label, res in (("(a) engine", a), ("(b) platform", b)):
        if not res.cpu:
            continue
        print()
        print(f"  CPU seconds by process, {label} "
              f"(machine has {os.cpu_count()} CPUs; 'other' = everyone else):")
        passes = list(res.cpu)
        crow = "    {:<28}" + "{:>12}" * len(passes)
        print(crow.format("pass", *passes))
        print(crow.format("wall", *(f"{res.cpu[p]['wall_s']:.2f}" for p in passes)))
        for role in res.cpu[passes[0]]["cpu_s"]:
            print(crow.format(role, *(f"{res.cpu[p]['cpu_s'][role]:.2f}" for p in passes)))
        print(crow.format("other (not this benchmark)",
                          *(f"{res.cpu[p]['other_cpu_s']:.2f}" for p in passes)))
    busy = {f"{label} {p}": res.cpu[p]["other_cpu_s"] / (res.cpu[p]["wall_s"] * (os.cpu_count() or 1))
            for label, res in (("a", a), ("b", b)) for p in res.cpu}
    noisy = {k: v for k, v in busy.items() if v > NOISY_SHARE}
    if noisy:
        print()
        print("  WARNING: other processes used a large share of the CPUs during "
              + ", ".join(f"{k} ({v:.0%})" for k, v in noisy.items())
              + ": these figures are skewed; rerun on a quiet machine.")

    return {
        "model": args.model, "model_path": model_path, "prompts": n, "max_tokens": args.max_tokens,
        "adapters": args.adapters,
        "host": {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()},
        "env": {k: os.environ.get(k) for k in ENV_SHOWN},
        "targets": {"throughput_ratio": TARGET_THROUGHPUT_RATIO, "added_latency_p50_ms": TARGET_ADDED_P50_MS},
        "figures": {
            "throughput_tok_s_a": a.tok_per_s,
            "throughput_tok_s_b": b.tok_per_s,
            "throughput_ratio_b_over_a": ratio,
            "throughput_pass": ratio >= TARGET_THROUGHPUT_RATIO,
            "added_latency_ms": summary(added),
            "added_latency_pass": added_p50 <= TARGET_ADDED_P50_MS,
            "latency_ms_a": summary([x * ms for x in a.latency_s]),
            "latency_ms_b": summary([x * ms for x in b.latency_s]),
            "ttft_ms_a": summary([x * ms for x in a.ttft_s]),
            "ttft_ms_b": summary([x * ms for x in b.ttft_s]),
            "added_ttft_ms": summary(added_ttft),
            "tokens_a": a.throughput_tokens,
            "tokens_b": b.throughput_tokens,
            "tokens_equal_every_pass": same_tokens,
            "texts_equal": same_text,
        },
        "hops_ms": hop_stats,
        "cpu_s": {"a": a.cpu, "b": b.cpu},
        "other_cpu_share": busy,
        "noisy": bool(noisy),
        "replica_generate_minus_engine_ms": summary(replica_extra),
        "outside_replica_generate_ms": summary(outside),
        "raw": {
            "a": {k: v for k, v in asdict(a).items() if k != "texts"},
            "b": {k: v for k, v in asdict(b).items() if k != "texts"},
            "hops": [asdict(h) for h in hops],
        },
    }


# --- main -------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/serving.json"))
    parser.add_argument("--adapters", choices=("on", "off"), default=None,
                        help="run-time adapters in both paths (default: the service's default, "
                             "LOOPLINE_ADAPTERS)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the stack keeps NATS data, logs and the model (default: a temp dir)")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.adapters is not None:
        os.environ["LOOPLINE_ADAPTERS"] = "1" if args.adapters == "on" else "0"
    from loopline.common.settings import InferenceSettings

    args.adapters = InferenceSettings().adapters  # what both paths run with
    from loopline.common.stack import LocalStack
    from loopline.ml.models.resolve import resolve_model

    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="loopline-bench-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(args.prompts, args.seed)
    warmup = make_prompts(args.prompts, args.seed + 1)
    try:
        # Into the stack's own models folder, so its replica loads the very same files.
        model_path = str(resolve_model(args.model, state_dir / "models"))

        print(f"(a) engine in-process: {model_path}", flush=True)
        print(f"    run-time adapters (vLLM LoRA machinery): {'on' if args.adapters else 'off'}")
        a = asyncio.run(bench_engine(model_path, args.model, prompts, warmup, args.max_tokens,
                                     args.adapters))
        gc.collect()

        print(f"(b) platform: starting LocalStack in {state_dir}", flush=True)
        stack = LocalStack(state_dir=state_dir, model=args.model, replicas=1,
                           env={"LOOPLINE_ADAPTERS": "1" if args.adapters else "0"})
        try:
            t0 = time.perf_counter()
            stack.start()
            startup = time.perf_counter() - t0
            print(f"    gateway at {stack.url} after {startup:.1f} s", flush=True)
            b, hops = asyncio.run(bench_platform(stack.url, stack.nats_url, args.model, prompts, warmup,
                                                 args.max_tokens, platform_roles(stack)))
            b.startup_s = startup
        finally:
            stack.stop()
            if stack.dead() != stack.procs():
                print("warning: some stack process outlived stop()", file=sys.stderr)

        figures = report(a, b, hops, args, model_path)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    finally:
        if args.state_dir is None:
            shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
