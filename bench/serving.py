"""Serving overhead: the same prompts through the engine in-process and through the whole platform.

    python bench/serving.py [--model tiny] [--prompts 64] [--max-tokens 32] [--rounds 45]
                            [--latency-rounds 3] [--out bench/results/serving.json]

One run measures, on the same deterministic prompts (greedy, same ``max_tokens``):

  (a) baseline: ``VllmEngine`` called in this process, with the settings the inference service uses
      and its ``PromptBuilder`` tokenization;
  (b) platform: HTTP -> gateway -> NATS JetStream -> inference replica -> NATS -> gateway -> HTTP,
      started with ``LocalStack`` exactly as ``make up`` does, one request per prompt;
  (c) the same platform, all prompts in one request (OpenAI's list ``prompt``), the way batch
      clients submit (ScalarLM's ``generate`` sends a list too): throughput rounds only.

All stay up for the whole run and take turns, never running together: every throughput round is
one burst of all prompts through each of (a), (b) and (c) (the order rotates), and the latency
and time-to-first-token passes send each prompt through (a) and then (b) (again alternating). So
every figure of (b) has a figure of (a) taken a moment apart: on a shared 2-core virtual machine
the speed of the CPUs themselves drifts by tens of percent over seconds, and comparing passes
taken minutes apart measured that drift more than the platform. The throughput ratios reported are
the medians of the rounds' ratios; the ranges say how much they spread.

Before (a) runs, the platform's bookkeeping of the previous (b) burst (the ledger's consumers) has
caught up, so (a) never shares the CPUs with (b)'s leftovers. It always exits 0: the targets are
reported, not enforced.
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
import sqlite3
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
# Pause between two bursts, after the platform's bookkeeping has caught up.
SETTLE_S = 0.2

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
    """CPU seconds each role's processes spent during a pass, summed over the pass's turns, and what
    the rest of the machine spent meanwhile.

    The machine has few cores and others may use them: the "other" column says how quiet it was.
    """

    def __init__(self, roles: dict[str, tuple[int, bool] | list[tuple[int, bool]]]):
        # role -> (pid, count its descendants too), or a list of them for a role of several processes
        self.roles = {r: v if isinstance(v, list) else [v] for r, v in roles.items()}
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
        if not self.roles:
            return
        cpu = {r: sum(self._cpu(pid, rec) for pid, rec in procs) for r, procs in self.roles.items()}
        self.marks[name] = (time.perf_counter(), cpu, self._machine_busy())

    def stop(self, name: str) -> None:
        if not self.roles:
            return
        wall0, cpu0, busy0 = self.marks.pop(name)
        wall = time.perf_counter() - wall0
        cpu = {r: sum(self._cpu(pid, rec) for pid, rec in procs) - cpu0[r] for r, procs in self.roles.items()}
        busy = self._machine_busy() - busy0
        acc = self.passes.setdefault(name, {"wall_s": 0.0, "cpu_s": dict.fromkeys(cpu, 0.0),
                                            "other_cpu_s": 0.0, "machine_cpu_s": 0.0, "turns": 0})
        acc["wall_s"] += wall
        for r, v in cpu.items():
            acc["cpu_s"][r] += v
        acc["other_cpu_s"] += max(busy - sum(cpu.values()), 0.0)
        acc["machine_cpu_s"] += busy
        acc["turns"] += 1


@dataclass
class Sample:
    """One request as the caller saw it; ``group``/``sent``/``received`` are (b)'s only."""

    total: float
    ttft: float
    tokens: int
    text: str
    group: str = ""
    sent: float = 0.0
    received: float = 0.0


@dataclass
class PathResult:
    """What one path measured; times in seconds, per prompt index where it is a list."""

    round_wall_s: list[float] = field(default_factory=list)
    round_tokens: list[list[int]] = field(default_factory=list)  # per round, per prompt
    texts: list[str] = field(default_factory=list)  # of the first round
    latency_s: list[float] = field(default_factory=list)
    latency_tokens: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    stream_total_s: list[float] = field(default_factory=list)
    stream_tokens: list[int] = field(default_factory=list)
    startup_s: float = 0.0
    cpu: dict = field(default_factory=dict)
    burst_hops: list[dict] = field(default_factory=list)  # (b) only: the last round's timeline

    def round_tok_per_s(self) -> list[float]:
        return [sum(t) / w for t, w in zip(self.round_tokens, self.round_wall_s, strict=True)]


# --- (a) the engine in-process ------------------------------------------------------------------------------
class EnginePath:
    """The very engine a replica runs: the service's factory and adapter settings (run-time adapters
    make vLLM set up its LoRA machinery, which costs base requests too) and its tokenization."""

    label = "(a) engine"

    def __init__(self, model_path: str, model_name: str, max_tokens: int, adapters: bool):
        self.model_path, self.model_name, self.adapters = model_path, model_name, adapters
        self.max_tokens = max_tokens
        self.engine = None
        self.builder = None
        self.startup_s = 0.0

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from loopline.common.settings import InferenceSettings
        from loopline.inference.engine import build_engine
        from loopline.inference.prompts import PromptBuilder

        t0 = time.perf_counter()
        defaults = InferenceSettings()
        self.engine = build_engine("vllm", self.model_path, max_model_len=None, max_inflight=MAX_NUM_SEQS,
                                   dtype=DTYPE, adapters=self.adapters, max_adapters=defaults.max_adapters,
                                   max_adapter_rank=defaults.max_adapter_rank)
        await self.engine.start()
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.builder = PromptBuilder(tokenizer, self.engine.info.max_model_len)
        self.startup_s = time.perf_counter() - t0

    def roles(self) -> dict[str, tuple[int, bool]]:
        # AsyncLLM runs its engine core in a child process whatever VLLM_ENABLE_V1_MULTIPROCESSING says.
        return {"frontend (this process)": (os.getpid(), False),
                "engine core": (_child_pid(os.getpid()), True)}

    async def one(self, text: str, stream: bool = False) -> Sample:
        """Tokenization counts, as the replica does it per request; ``stream`` as (b)'s requests:
        deltas only for the time-to-first-token pass."""
        from loopline.common.schemas import SamplingParams, WorkItem

        start = time.perf_counter()
        rid = uuid.uuid4().hex
        item = WorkItem(request_id=rid, group=rid, index=0, model=self.model_name, prompt=text,
                        sampling=SamplingParams(max_tokens=self.max_tokens, temperature=0.0), stream=stream)
        request = self.builder.build(item)
        first = None
        tokens = 0
        out = []
        async for delta in self.engine.generate(request):
            if first is None and delta.text:
                first = time.perf_counter() - start
            tokens = delta.tokens
            out.append(delta.text)
        return Sample(time.perf_counter() - start, first if first is not None else float("nan"), tokens,
                      "".join(out))

    async def burst(self, prompts: list[str]) -> list[Sample]:
        return list(await asyncio.gather(*(self.one(t) for t in prompts)))

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
            gc.collect()


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
class PlatformPath:
    """The platform through its OpenAI route, from an aiohttp client.

    The client shares the machine with what it measures, so it should cost as little as possible:
    per request aiohttp spent about a third of the CPU httpx did here (a real client runs
    elsewhere). Its CPU is still counted in the table, as "client (this process)".
    """

    label = "(b) platform"

    def __init__(self, stack, model_name: str, max_tokens: int):
        self.stack = stack
        self.body = {"model": model_name, "max_tokens": max_tokens, "temperature": 0}
        self.session = None
        self.startup_s = 0.0

    async def start(self) -> None:
        import aiohttp

        # No connection limit: a burst gets one connection per request, as independent clients would.
        # Kept between bursts, as a client's pool would (the gateway keeps idle ones for
        # LOOPLINE_KEEP_ALIVE_S, 75 s): new connections would cost (b) some 20 ms a burst. Closed
        # well before the gateway closes them, or a reuse could race the server's close.
        self.session = aiohttp.ClientSession(base_url=self.stack.url,
                                             connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
                                             timeout=aiohttp.ClientTimeout(total=600))

    def roles(self) -> dict[str, tuple[int, bool]]:
        return platform_roles(self.stack)

    async def one(self, text: str, stream: bool = False) -> Sample:
        payload = {**self.body, "prompt": text}
        if stream:
            payload |= {"stream": True, "stream_options": {"include_usage": True}}
        sent = time.time()
        start = time.perf_counter()
        async with self.session.post("/v1/completions", json=payload) as r:
            r.raise_for_status()
            if not stream:
                data = await r.json()
                total = time.perf_counter() - start
                return Sample(total, float("nan"), data["usage"]["completion_tokens"],
                              data["choices"][0]["text"], data["id"].removeprefix("cmpl-"), sent, time.time())
            first = None
            tokens = 0
            out = []
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if first is None:
                        first = time.perf_counter() - start
                    out.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return Sample(time.perf_counter() - start, first if first is not None else float("nan"), tokens,
                      "".join(out))

    async def burst(self, prompts: list[str]) -> list[Sample]:
        """Every prompt its own request, all at once, as many independent clients would."""
        return list(await asyncio.gather(*(self.one(t) for t in prompts)))

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()


class PlatformBatchPath:
    """(c): the whole burst as one OpenAI request with a list ``prompt``, on (b)'s platform and
    client. The gateway still makes one work item per prompt, so the replica and the engine do the
    same work as for (b); what it leaves out is the HTTP and gateway cost of 64 requests, which on
    a small machine shares the one core the engine leaves."""

    label = "(c) one request"

    def __init__(self, single: PlatformPath):
        self.single = single
        self.startup_s = 0.0

    def roles(self) -> dict[str, tuple[int, bool]]:
        return self.single.roles()

    async def burst(self, prompts: list[str]) -> list[Sample]:
        """One Sample per prompt, in prompt order. OpenAI's response counts tokens for the whole
        request only, so the first Sample carries them all (a round's sum is what is compared)."""
        start = time.perf_counter()
        async with self.single.session.post("/v1/completions",
                                            json={**self.single.body, "prompt": prompts}) as r:
            r.raise_for_status()
            data = await r.json()
        total = time.perf_counter() - start
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise RuntimeError(f"asked for {len(prompts)} completions, got {len(choices)}")
        used = data["usage"]["completion_tokens"]
        return [Sample(total, float("nan"), used if i == 0 else 0, c["text"])
                for i, c in enumerate(choices)]


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
    """Watches work items and results on core NATS to time each hop of a request (latency pass
    only: in a burst its own callbacks would take CPU from what it measures), and tells when the
    ledger has caught up."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.work: dict[str, tuple[float, float]] = {}      # group -> (submitted_at, seen)
        self.results: dict[str, tuple[float, float, float]] = {}  # group -> (started, finished, seen)
        self.nc = None
        self.subs = []

    async def open(self) -> None:
        import nats

        self.nc = await nats.connect(self.nats_url, name="bench-tap")

    async def watch(self) -> None:
        from loopline.common import subjects

        async def on_work(msg) -> None:
            seen = time.time()
            item = json.loads(msg.data)
            self.work[item["group"]] = (item["submitted_at"], seen)

        async def on_result(msg) -> None:
            seen = time.time()
            item = json.loads(msg.data)
            self.results[item["group"]] = (item["started_at"], item["finished_at"], seen)

        self.subs = [await self.nc.subscribe(subjects.WORK_ALL, cb=on_work),
                     await self.nc.subscribe(subjects.RESULTS_ALL, cb=on_result)]
        await self.nc.flush()

    async def unwatch(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
        self.subs = []

    async def ledger_caught_up(self, timeout_s: float = 10.0) -> bool:
        """Both ledger consumers have nothing pending or unacked (or ``timeout_s`` passed)."""
        from loopline.common import subjects

        js = self.nc.jetstream()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [await js.consumer_info(subjects.WORK_STREAM, subjects.LEDGER_WORK_DURABLE),
                     await js.consumer_info(subjects.RESULTS_STREAM, subjects.LEDGER_RESULTS_DURABLE)]
            if all(not i.num_pending and not i.num_ack_pending for i in infos):
                return True
            await asyncio.sleep(0.05)
        return False

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
        "trainer": (stack.trainer.pid, True),
        "checkpoint-watcher": (stack.checkpoint_watcher.pid, True),
        "replica (worker+AsyncLLM)": (replica.pid, False),
        "engine core": (_child_pid(replica.pid), True),
    }


def burst_timeline(ledger_db: Path, samples: list[Sample]) -> list[dict]:
    """The last (b) round as the ledger recorded it: when each prompt's work item was built
    (enqueued_at), started by the replica and finished, next to the client's send and receive."""
    by_group = {s.group: s for s in samples}
    with contextlib.closing(sqlite3.connect(f"file:{ledger_db}?mode=ro", uri=True)) as db:
        marks = ",".join("?" * len(by_group))
        rows = db.execute(f"SELECT group_id, enqueued_at, started_at, completed_at FROM requests "
                          f"WHERE group_id IN ({marks})", list(by_group)).fetchall()
    return [{"sent": by_group[g].sent, "submitted": q, "started": s, "finished": f,
             "received": by_group[g].received} for g, q, s, f in rows if s and f]


# --- the run: (a) and (b) take turns ---------------------------------------------------------------------
async def measure(a: EnginePath, b: PlatformPath, c: PlatformBatchPath, tap: Tap, prompts: list[str],
                  warmup: list[str], rounds: int, ledger_db: Path,
                  latency_rounds: int = 1) -> tuple[PathResult, PathResult, PathResult, list[Hops]]:
    results = {a: PathResult(startup_s=a.startup_s), b: PathResult(startup_s=b.startup_s),
               c: PathResult(startup_s=b.startup_s)}
    # Both paths stay up: while (a) runs, the idle platform's own timers (admission state, the
    # watcher's rescan, the trainer's reconcile) still take a little CPU, shown as a role of (a).
    idle_platform = [v for k, v in b.roles().items() if k != "client (this process)"]
    meters = {a: CpuMeter({**a.roles(), "platform, idle": idle_platform}), b: CpuMeter(b.roles()),
              c: CpuMeter(c.roles())}

    async def settle() -> None:
        # (b)'s ledger writes come after its answers; let them finish before anything else runs.
        await tap.ledger_caught_up()
        await asyncio.sleep(SETTLE_S)

    def turns(i: int) -> tuple:
        return (a, b) if i % 2 == 0 else (b, a)

    def rotation(i: int) -> tuple:
        # Each path goes first, second and third equally often over the rounds.
        order = (a, b, c)
        return order[i % 3:] + order[:i % 3]

    for path in (a, b):
        for text in warmup[:WARMUP_SEQUENTIAL]:
            await path.one(text)
            await path.one(text, stream=True)
        await path.burst(warmup)
    await c.burst(warmup)
    # As every service does once it is up (loopline/common/runtime.py, serve): the engine's
    # long-lived heap out of the collector's way, so (a) and this process's client do not pause for it.
    gc.collect()
    gc.freeze()

    last_b: list[Sample] = []
    for r in range(rounds):
        for path in rotation(r):
            await settle()
            meters[path].start("throughput")
            start = time.perf_counter()
            outs = await path.burst(prompts)
            wall = time.perf_counter() - start
            meters[path].stop("throughput")
            res = results[path]
            res.round_wall_s.append(wall)
            res.round_tokens.append([o.tokens for o in outs])
            if r == 0:
                res.texts = [o.text for o in outs]
            if path is b:
                last_b = outs

    await settle()
    if ledger_db.exists():  # noqa: ASYNC240 - one stat, after the measured rounds
        results[b].burst_hops = burst_timeline(ledger_db, last_b)

    await tap.watch()
    timed = []
    # Each pair differs by the engine's own jitter (a few ms either way on this machine) as much as
    # by the platform, so one pass of the prompts pins the median down to about a millisecond;
    # latency_rounds passes narrow that.
    paired = [text for _ in range(latency_rounds) for text in prompts]
    for i, text in enumerate(paired):
        for path in turns(i):
            meters[path].start("latency")
            sample = await path.one(text)
            meters[path].stop("latency")
            results[path].latency_s.append(sample.total)
            results[path].latency_tokens.append(sample.tokens)
            if path is b:
                timed.append((i, sample.group, sample.sent, sample.received))
    for i, text in enumerate(paired):
        for path in turns(i):
            meters[path].start("ttft")
            sample = await path.one(text, stream=True)
            meters[path].stop("ttft")
            results[path].ttft_s.append(sample.ttft)
            results[path].stream_total_s.append(sample.total)
            results[path].stream_tokens.append(sample.tokens)
    # The tap's callbacks may run after the client already has its answer: look up last.
    await asyncio.sleep(0.2)
    await tap.unwatch()
    hops = [h for h in (tap.hops(*t) for t in timed) if h is not None]
    for path in (a, b, c):
        results[path].cpu = meters[path].passes
    return results[a], results[b], results[c], hops


# --- report -----------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def pooled_ratio(x: PathResult, y: PathResult) -> float:
    """y's throughput over x's, over all rounds together."""
    return ((sum(map(sum, y.round_tokens)) / sum(y.round_wall_s))
            / (sum(map(sum, x.round_tokens)) / sum(x.round_wall_s)))


def report(a: PathResult, b: PathResult, c: PathResult, hops: list[Hops], args, model_path: str) -> dict:
    ms = 1000.0
    added = [(lb - la) * ms for la, lb in zip(a.latency_s, b.latency_s, strict=True)]
    added_ttft = [(tb - ta) * ms for ta, tb in zip(a.ttft_s, b.ttft_s, strict=True)]
    tps_a, tps_b, tps_c = a.round_tok_per_s(), b.round_tok_per_s(), c.round_tok_per_s()
    ratios = [y / x for x, y in zip(tps_a, tps_b, strict=True)]
    ratios_c = [y / x for x, y in zip(tps_a, tps_c, strict=True)]
    ratio, ratio_c = percentile(ratios, 50), percentile(ratios_c, 50)
    pooled, pooled_c = pooled_ratio(a, b), pooled_ratio(a, c)
    same_tokens = (a.round_tokens == b.round_tokens and a.latency_tokens == b.latency_tokens
                   and a.stream_tokens == b.stream_tokens
                   # (c) has one token count per request: compare each round's total
                   and [sum(t) for t in a.round_tokens] == [sum(t) for t in c.round_tokens])
    same_text = a.texts == b.texts == c.texts
    added_p50 = percentile(added, 50)

    hop_stats = {}
    for name, x, y in HOP_NAMES:
        hop_stats[name] = summary([(getattr(h, y) - getattr(h, x)) * ms for h in hops])
    # What the replica spent against what the engine alone spent on the same prompt.
    replica_extra = [(h.finished - h.started) * ms - a.latency_s[h.index] * ms for h in hops]
    # The platform's own cost, from (b) alone: the client's wait minus the replica's tokenize+generate
    # window. Unlike b - a it does not compare two moments of a machine others may be using.
    outside = [(h.received - h.sent - (h.finished - h.started)) * ms for h in hops]

    n = args.prompts
    rounds = len(ratios)
    print()
    print(f"Loopline serving benchmark — model {args.model!r} ({model_path}), {n} prompts, "
          f"max_tokens {args.max_tokens}, greedy, run-time adapters {'on' if args.adapters else 'off'}, "
          f"{rounds} throughput rounds, {len(added)} latency and TTFT pairs "
          f"({args.latency_rounds} per prompt)")
    print("  (a) VllmEngine in-process      (b) HTTP -> gateway -> NATS -> inference replica, a request"
          " per prompt")
    print(f"  (c) as (b), the {n} prompts in one request (throughput only)")
    print("  " + " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in ENV_SHOWN))
    print()
    trow = "{:<36}{:>14}{:>14}{:>14}"
    print(trow.format("throughput rounds", "(a) engine", "(b) requests", "(c) one"))
    print(trow.format("tok/s (median round)", *(f"{percentile(t, 50):.1f}" for t in (tps_a, tps_b, tps_c))))
    print(trow.format("burst wall, ms (median round)",
                      *(f"{percentile(p.round_wall_s, 50) * ms:.0f}" for p in (a, b, c))))
    print(trow.format("generated tokens, first round", *(sum(p.round_tokens[0]) for p in (a, b, c))))
    print(trow.format("x (a), median of round ratios", "", f"x{ratio:.3f}", f"x{ratio_c:.3f}"))
    print(trow.format("x (a), all rounds pooled", "", f"x{pooled:.3f}", f"x{pooled_c:.3f}"))
    print(trow.format("round ratios, min..max", "", f"{min(ratios):.2f}..{max(ratios):.2f}",
                      f"{min(ratios_c):.2f}..{max(ratios_c):.2f}"))
    print()
    row = "{:<36}{:>14}{:>14}{:>14}"
    print(row.format("one request at a time", "(a) engine", "(b) platform", "b - a"))
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
    for name, rs in (("b/a", ratios), ("c/a", ratios_c)):
        print(f"  round ratios {name}: min {min(rs):.3f}, p25 {percentile(rs, 25):.3f}, "
              f"p75 {percentile(rs, 75):.3f}, max {max(rs):.3f}")
    print(f"  tokens equal on every pass: {same_tokens}   texts equal (first round): {same_text}")
    print()
    print(f"  throughput b/a = {ratio:.3f}, median of {rounds} rounds  "
          f"(target >= {TARGET_THROUGHPUT_RATIO})  "
          f"{verdict(ratio >= TARGET_THROUGHPUT_RATIO)}  ({n} requests at once)")
    print(f"  throughput c/a = {ratio_c:.3f}, median of {rounds} rounds  "
          f"(target >= {TARGET_THROUGHPUT_RATIO})  "
          f"{verdict(ratio_c >= TARGET_THROUGHPUT_RATIO)}  (one request of {n} prompts)")
    print(f"  added latency p50 = {added_p50:.2f} ms  (target <= {TARGET_ADDED_P50_MS} ms)  "
          f"{verdict(added_p50 <= TARGET_ADDED_P50_MS)}")
    print(f"  added latency p99 = {percentile(added, 99):.2f} ms")
    print(f"  TTFT p50 a = {percentile(a.ttft_s, 50) * ms:.2f} ms, "
          f"b = {percentile(b.ttft_s, 50) * ms:.2f} ms, added = {percentile(added_ttft, 50):.2f} ms")
    if outside:
        print(f"  (b) time outside the replica's generate window: p50 {percentile(outside, 50):.2f} ms, "
              f"p99 {percentile(outside, 99):.2f} ms  (the added latency within (b) alone)")
    if hops:
        print()
        print(f"  where a (b) request's time goes, latency pass ({len(hops)} requests), ms:")
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
        first = lambda key: (min(h[key] for h in bh) - t0) * ms  # noqa: E731
        last = lambda key: (max(h[key] for h in bh) - t0) * ms  # noqa: E731
        span = lambda key: f"{first(key):.0f}..{last(key):.0f}"  # noqa: E731
        print()
        print("  last throughput round of (b), from the ledger, ms after the first POST was sent: "
              f"last POST sent {last('sent'):.0f}, work items built {span('submitted')}, "
              f"started by the replica {span('started')}, results built {span('finished')}, "
              f"last response received {last('received'):.0f}")

    for label, res in (("(a) engine", a), ("(b) platform", b), ("(c) one request", c)):
        if not res.cpu:
            continue
        print()
        print(f"  CPU seconds by process, {label}, per turn "
              f"(machine has {os.cpu_count()} CPUs; 'other' = everyone else):")
        passes = list(res.cpu)
        turns = {p: max(res.cpu[p]["turns"], 1) for p in passes}
        crow = "    {:<28}" + "{:>12}" * len(passes)
        print(crow.format("pass (turns)", *(f"{p} ({turns[p]})" for p in passes)))
        print(crow.format("wall", *(f"{res.cpu[p]['wall_s'] / turns[p]:.3f}" for p in passes)))
        for role in res.cpu[passes[0]]["cpu_s"]:
            print(crow.format(role, *(f"{res.cpu[p]['cpu_s'][role] / turns[p]:.3f}" for p in passes)))
        print(crow.format("other (not this benchmark)",
                          *(f"{res.cpu[p]['other_cpu_s'] / turns[p]:.3f}" for p in passes)))
    busy = {f"{label} {p}": res.cpu[p]["other_cpu_s"] / (res.cpu[p]["wall_s"] * (os.cpu_count() or 1))
            for label, res in (("a", a), ("b", b), ("c", c)) for p in res.cpu}
    noisy = {k: v for k, v in busy.items() if v > NOISY_SHARE}
    if noisy:
        print()
        print("  WARNING: other processes used a large share of the CPUs during "
              + ", ".join(f"{k} ({v:.0%})" for k, v in noisy.items())
              + ": these figures are skewed; rerun on a quiet machine.")

    return {
        "model": args.model, "model_path": model_path, "prompts": n, "max_tokens": args.max_tokens,
        "adapters": args.adapters, "rounds": rounds, "latency_rounds": args.latency_rounds,
        "host": {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()},
        "env": {k: os.environ.get(k) for k in ENV_SHOWN},
        "targets": {"throughput_ratio": TARGET_THROUGHPUT_RATIO, "added_latency_p50_ms": TARGET_ADDED_P50_MS},
        "figures": {
            "throughput_tok_s_a_median_round": percentile(tps_a, 50),
            "throughput_tok_s_b_median_round": percentile(tps_b, 50),
            "throughput_ratio_b_over_a": ratio,
            "throughput_ratio_rounds": summary(ratios),
            "throughput_ratio_all_rounds": pooled,
            "throughput_pass": ratio >= TARGET_THROUGHPUT_RATIO,
            "throughput_tok_s_c_median_round": percentile(tps_c, 50),
            "throughput_ratio_c_over_a": ratio_c,
            "throughput_ratio_c_rounds": summary(ratios_c),
            "throughput_ratio_c_all_rounds": pooled_c,
            "throughput_c_pass": ratio_c >= TARGET_THROUGHPUT_RATIO,
            "added_latency_ms": summary(added),
            "added_latency_pass": added_p50 <= TARGET_ADDED_P50_MS,
            "latency_ms_a": summary([x * ms for x in a.latency_s]),
            "latency_ms_b": summary([x * ms for x in b.latency_s]),
            "ttft_ms_a": summary([x * ms for x in a.ttft_s]),
            "ttft_ms_b": summary([x * ms for x in b.ttft_s]),
            "added_ttft_ms": summary(added_ttft),
            "tokens_per_round": sum(a.round_tokens[0]),
            "tokens_equal_every_pass": same_tokens,
            "texts_equal": same_text,
        },
        "hops_ms": hop_stats,
        "cpu_s": {"a": a.cpu, "b": b.cpu, "c": c.cpu},
        "other_cpu_share": busy,
        "noisy": bool(noisy),
        "replica_generate_minus_engine_ms": summary(replica_extra),
        "outside_replica_generate_ms": summary(outside),
        "raw": {
            "a": {k: v for k, v in asdict(a).items() if k != "texts"},
            "b": {k: v for k, v in asdict(b).items() if k != "texts"},
            "c": {k: v for k, v in asdict(c).items() if k not in ("texts", "burst_hops")},
            "hops": [asdict(h) for h in hops],
        },
    }


# --- main -------------------------------------------------------------------------------------------------
async def run_both(model_path: str, stack, args, prompts: list[str], warmup: list[str]):
    a = EnginePath(model_path, args.model, args.max_tokens, args.adapters)
    b = PlatformPath(stack, args.model, args.max_tokens)
    c = PlatformBatchPath(b)
    tap = Tap(stack.nats_url)
    try:
        await a.start()
        await b.start()
        await tap.open()
        return await measure(a, b, c, tap, prompts, warmup, args.rounds, stack.state_dir / "loopline.db",
                             args.latency_rounds)
    finally:
        await tap.close()
        await b.stop()
        await a.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=45,
                        help="throughput rounds, each (a), (b) and (c) once (a multiple of 3 rotates evenly)")
    parser.add_argument("--latency-rounds", type=int, default=3,
                        help="passes of the prompts, one request at a time, for latency and TTFT pairs")
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
        print(f"(b) platform: starting LocalStack in {state_dir}", flush=True)
        stack = LocalStack(state_dir=state_dir, model=args.model, replicas=1,
                           env={"LOOPLINE_ADAPTERS": "1" if args.adapters else "0"})
        try:
            t0 = time.perf_counter()
            stack.start()
            startup = time.perf_counter() - t0
            print(f"    gateway at {stack.url} after {startup:.1f} s", flush=True)
            print(f"(a) engine in-process: {model_path}, run-time adapters "
                  f"{'on' if args.adapters else 'off'}", flush=True)
            a, b, c, hops = asyncio.run(run_both(model_path, stack, args, prompts, warmup))
            b.startup_s = c.startup_s = startup
        finally:
            stack.stop()
            if stack.dead() != stack.procs():
                print("warning: some stack process outlived stop()", file=sys.stderr)

        figures = report(a, b, c, hops, args, model_path)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    finally:
        if args.state_dir is None:
            shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
