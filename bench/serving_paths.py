"""What ``serving.py`` measures with: its prompts and statistics, the HTTP client both paths share,
the NATS tap that times a Loopline request hop by hop and tells when the ledger has caught up, and
the CPU meter that says how quiet the machine was."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field

# Settings that change CPU inference speed a lot; printed with the figures.
ENV_SHOWN = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
             "VLLM_ENABLE_V1_MULTIPROCESSING")
# Above this share of the machine's CPUs used by other processes during a pass, say the run is noisy.
NOISY_SHARE = 0.10

_WORDS = (
    "the a of to in on for with and or but not is are was be have do will can this that it they "
    "we you model token text data train step loss answer question user prompt reply small large "
    "fast slow time day city river mountain water fire red green blue one two three ten hundred "
    "queue worker result engine batch stream gateway latency request cache memory"
).split()


def make_prompts(count: int, seed: int) -> list[str]:
    """``count`` deterministic prompts whose lengths spread from a few words to a few hundred."""
    rng = random.Random(seed)
    lengths = [4 + (i * 300) // max(count - 1, 1) for i in range(count)]
    rng.shuffle(lengths)
    return [f"Request {i}: {' '.join(rng.choice(_WORDS) for _ in range(n))}. Answer:"
            for i, n in enumerate(lengths)]


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


@dataclass
class Sample:
    """One request as the client saw it (wall times in seconds; ``sent``/``received`` epoch)."""

    total: float
    ttft: float
    tokens: int
    text: str
    sent: float = 0.0
    received: float = 0.0


@dataclass
class PathResult:
    """What one path measured; times in seconds, per prompt where it is a list."""

    round_wall_s: list[float] = field(default_factory=list)
    round_tokens: list[int] = field(default_factory=list)  # generated in each round's burst
    texts: list[str] = field(default_factory=list)  # of the first round
    latency_s: list[float] = field(default_factory=list)
    latency_tokens: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    stream_total_s: list[float] = field(default_factory=list)
    stream_tokens: list[int] = field(default_factory=list)
    cpu: dict = field(default_factory=dict)

    def round_tok_per_s(self) -> list[float]:
        return [t / w for t, w in zip(self.round_tokens, self.round_wall_s, strict=True)]


class HttpPath:
    """An OpenAI-compatible server at ``url``, asked by the one client code both paths share.

    The client shares the machine with what it measures, so it should cost as little as possible:
    a burst of 64 requests took 12 ms of this process's CPU with aiohttp and 487 ms with httpx
    (against `vllm serve`, 8 bursts each, alternating), which on 2 cores is CPU taken from both
    servers. Its CPU is counted in the tables, as "client (this process)".

    Connections stay open between bursts, as any client's pool keeps them (opening 64 would cost a
    burst some 20 ms here); they expire before either server closes them (both keep idle ones for
    the gateway's ``keep_alive_s``, serving.py sets it for ``vllm serve``), or a reuse could race
    the server's close.
    """

    def __init__(self, label: str, url: str, model: str, max_tokens: int, keepalive_s: float = 30.0):
        self.label, self.url, self.keepalive_s = label, url, keepalive_s
        self.body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        self.session = None

    async def start(self) -> None:
        import aiohttp

        # No connection limit: a burst gets one connection per request, as independent clients would.
        self.session = aiohttp.ClientSession(
            base_url=self.url, timeout=aiohttp.ClientTimeout(total=600),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s))

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
                return Sample(time.perf_counter() - start, float("nan"), data["usage"]["completion_tokens"],
                              data["choices"][0]["text"], sent, time.time())
            first = None
            tokens = 0
            out = []
            # Invariant: out holds the text of every event read so far, in order.
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
                      "".join(out), sent, time.time())

    async def burst(self, prompts: list[str]) -> list[Sample]:
        """Every prompt its own request, all at once, as many independent clients would."""
        return list(await asyncio.gather(*(self.one(t) for t in prompts)))

    async def batch(self, prompts: list[str]) -> list[Sample]:
        """(c): all prompts in one request. OpenAI's answer counts tokens for the whole request
        only, so the first Sample carries them all (a round's sum is what is compared)."""
        start = time.perf_counter()
        async with self.session.post("/v1/completions", json={**self.body, "prompt": prompts}) as r:
            r.raise_for_status()
            data = await r.json()
        total = time.perf_counter() - start
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise RuntimeError(f"{self.label}: asked for {len(prompts)} completions, got {len(choices)}")
        used = data["usage"]["completion_tokens"]
        return [Sample(total, float("nan"), used if i == 0 else 0, c["text"]) for i, c in enumerate(choices)]

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()


class PlatformPath(HttpPath):
    """Loopline's gateway of a ``LocalStack`` (ab_serving.py uses this too)."""

    def __init__(self, stack, model: str, max_tokens: int, keepalive_s: float = 30.0):
        super().__init__("(b) Loopline", stack.url, model, max_tokens, keepalive_s)


@dataclass
class Hops:
    """Timestamps (time.time()) of one non-streaming Loopline request: the client's and those the
    services write into the messages. Not the tap's own receive times: the bench's synchronous CPU
    readings after each request hold its event loop, so the tap saw results some 50 ms (p50) after
    the client already had them."""

    index: int = 0               # pair index in the latency pass
    sent: float = 0.0            # client sends the POST
    submitted: float = 0.0       # gateway built the WorkItem (WorkItem.submitted_at)
    started: float = 0.0         # replica began (ResultItem.started_at)
    finished: float = 0.0        # replica built the result (ResultItem.finished_at)
    received: float = 0.0        # client has the whole response


HOP_NAMES = [
    ("client -> gateway WorkItem", "sent", "submitted"),
    ("WorkItem -> NATS -> replica", "submitted", "started"),
    ("replica: vLLM's app call", "started", "finished"),
    ("result -> NATS -> gateway -> client", "finished", "received"),
]


class Tap:
    """Watches work items and results on core NATS to time each hop of a request (latency pass
    only: in a burst its callbacks would take CPU from what it measures), and tells when the
    ledger has caught up."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        # The answer is vLLM's, with vLLM's id: a request is found by its prompt, whose work items
        # queue up in the order they came (the latency pass repeats prompts, one at a time).
        self.work: dict[str, deque[tuple[str, float]]] = {}  # prompt -> (group, submitted_at)
        self.results: dict[str, tuple[float, float]] = {}  # group -> (started_at, finished_at)
        self.nc = None
        self.subs = []

    async def open(self) -> None:
        import nats

        self.nc = await nats.connect(self.nats_url, name="bench-tap")

    async def watch(self) -> None:
        from loopline.common.contracts import subjects

        async def on_work(msg) -> None:
            item = json.loads(msg.data)
            if not item.get("stream"):
                prompt = json.loads(item["body"]).get("prompt")
                if isinstance(prompt, str):
                    self.work.setdefault(prompt, deque()).append((item["group"], item["submitted_at"]))

        async def on_result(msg) -> None:
            item = json.loads(msg.data)
            self.results[item["group"]] = (item["started_at"], item["finished_at"])

        self.subs = [await self.nc.subscribe(subjects.WORK_ALL, cb=on_work),
                     await self.nc.subscribe(subjects.RESULTS_ALL, cb=on_result)]
        await self.nc.flush()

    async def unwatch(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
        self.subs = []

    async def ledger_caught_up(self, timeout_s: float = 10.0) -> bool:
        """Both ledger consumers have nothing pending or unacked (or ``timeout_s`` passed)."""
        from loopline.common.contracts import subjects

        js = self.nc.jetstream()
        deadline = time.monotonic() + timeout_s
        # Invariant: at the last look, some ledger consumer still had work.
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

    def hops(self, index: int, prompt: str, sample: Sample) -> Hops | None:
        """The hops of the oldest request for ``prompt`` not yet looked up."""
        queued = self.work.get(prompt)
        if not queued:
            return None
        group, submitted = queued.popleft()
        if group not in self.results:
            return None
        started, finished = self.results[group]
        return Hops(index, sample.sent, submitted, started, finished, sample.received)


# --- CPU -------------------------------------------------------------------------------------------------
Roles = dict[str, list[tuple[int, bool]]]  # role -> [(pid, count its descendants too)]


def _child_pid(pid: int, marker: str = "EngineCore") -> int:
    """The child of ``pid`` whose command line or name holds ``marker`` (vLLM's engine core renames
    itself), or -1."""
    import psutil

    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return -1
    for kid in kids:
        try:
            if marker in " ".join(kid.cmdline()) or marker in kid.name():
                return kid.pid
        except psutil.Error:
            pass
    return -1


def vllm_serve_roles() -> Roles:
    """``vllm serve`` (a child of this process): its API server and its engine core."""
    server = _child_pid(os.getpid(), "vllm.entrypoints.openai.api_server")
    return {"vllm serve API server": [(server, False)],
            "vllm serve engine core": [(_child_pid(server), True)]}


def platform_roles(stack) -> Roles:
    replica = next(iter(stack.inference.values()))
    return {"gateway": [(stack.gateway.pid, True)], "nats-server": [(stack.nats.pid, True)],
            "queue": [(stack.queue.pid, True)],
            "trainer, checkpoint-watcher": [(stack.trainer.pid, True), (stack.checkpoint_watcher.pid, True)],
            "replica (worker + vLLM's app)": [(replica.pid, False)],
            "replica engine core": [(_child_pid(replica.pid), True)]}


class CpuMeter:
    """CPU seconds each role's processes spent during a pass, summed over the pass's turns, and what
    the rest of the machine spent meanwhile: the "other" column says how quiet it was."""

    def __init__(self, roles: Roles):
        self.roles = roles
        self.marks: dict[str, tuple[float, dict[str, float], float]] = {}
        self.passes: dict[str, dict] = {}

    @staticmethod
    def _cpu(pid: int, recursive: bool) -> float:
        import psutil

        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)] if recursive else [proc]
        except (psutil.Error, ValueError):
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _roles_cpu(self) -> dict[str, float]:
        return {r: sum(self._cpu(pid, rec) for pid, rec in procs) for r, procs in self.roles.items()}

    @staticmethod
    def _machine_busy() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(v for k, v in t._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))

    def start(self, name: str) -> None:
        self.marks[name] = (time.perf_counter(), self._roles_cpu(), self._machine_busy())

    def stop(self, name: str) -> None:
        wall0, cpu0, busy0 = self.marks.pop(name)
        wall = time.perf_counter() - wall0
        cpu = {r: v - cpu0[r] for r, v in self._roles_cpu().items()}
        busy = self._machine_busy() - busy0
        acc = self.passes.setdefault(name, {"wall_s": 0.0, "cpu_s": dict.fromkeys(cpu, 0.0),
                                            "other_cpu_s": 0.0, "machine_cpu_s": 0.0, "turns": 0})
        acc["wall_s"] += wall
        for r, v in cpu.items():
            acc["cpu_s"][r] += v
        acc["other_cpu_s"] += max(busy - sum(cpu.values()), 0.0)
        acc["machine_cpu_s"] += busy
        acc["turns"] += 1

    def other_share(self) -> dict[str, float]:
        """Per pass, the share of the machine's CPUs that processes outside the roles used."""
        cpus = os.cpu_count() or 1
        return {p: acc["other_cpu_s"] / (acc["wall_s"] * cpus) for p, acc in self.passes.items()}
