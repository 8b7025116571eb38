"""The soak itself, shared by ``bench/soak.py`` (minutes to hours) and ``tests/e2e/test_soak.py``
(a minute and a quarter): mixed load on a started ``LocalStack``, a fault every ``fault_every_s`` (``kill -9``
of a replica, the gateway, the queue, the trainer or the checkpoint-watcher and a fresh start of
it; nats-server restarted on its data), samples at the start (after a warm-up), every
``sample_every_s`` and at the end (after the load drained), and the verdict.

A service that exits without being killed is started again as a supervisor would (compose,
Kubernetes) and listed under ``unexpected_exits``: the runtime's policy is to exit when a dependency
stays lost, so an exit is a finding to read, not by itself a breach.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from loopline.common.local.stack import LocalStack
from support.soak_load import Load
from support.soak_probe import Limits, breaches, table, take_sample

FAULT_KINDS = ("replica", "gateway", "queue", "trainer", "checkpoint-watcher", "nats")


@dataclass
class SoakConfig:
    minutes: float = 30.0  # from the start sample to the end of load
    warmup_s: float = 30.0  # load before the start sample (engines warm, connections open)
    fault_every_s: float = 150.0  # 0: no faults
    faults: tuple[str, ...] = FAULT_KINDS  # taken in a seeded shuffled order, round after round
    quiet_end_s: float = 60.0  # no fault this close to the end: the end sample is not of a restart
    sample_every_s: float = 300.0
    openai_clients: int = 2
    openai_pause_s: float = 0.2
    batch_size: int = 16
    batch_pause_s: float = 2.0
    train_every_s: float = 300.0  # 0: no training jobs
    tinker_every_s: float = 0.0  # a Tinker session's step this often; 0: no Tinker session
    max_tokens: int = 16
    answer_deadline_s: float = 240.0  # a request unanswered this long after it started: breach
    settle_s: float = 10.0  # after the drain, before the end sample
    seed: int = 0
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")


class Chaos:
    """The faults and the supervisor, one at a time under ``lock`` (samples take it too, so none is
    taken half-way through a restart)."""

    def __init__(self, stack: LocalStack, config: SoakConfig, started: float):
        self.stack = stack
        self.config = config
        self.started = started
        self.lock = asyncio.Lock()
        self.rng = random.Random(config.seed)
        self.faults: list[dict] = []
        self.unexpected_exits: list[dict] = []
        self.restarts: Counter = Counter()  # by process name

    def kinds(self):
        """The fault kinds, every one once per round, in a new seeded order each round."""
        # Invariant: each round yields every configured kind exactly once.
        while True:
            yield from self.rng.sample(self.config.faults, len(self.config.faults))

    def inflict(self, kind: str) -> str:
        """Blocking: one fault and the restart after it; the name of the process hit."""
        stack = self.stack
        if kind == "replica":
            name = self.rng.choice(sorted(stack.inference))
            stack.restart_replica(name)
            return f"inference-{name}"
        if kind == "nats":
            stack.restart_nats()
            return "nats"
        stack.restart_service(kind)
        return kind

    async def faulting(self, until: float) -> None:
        kinds = self.kinds()
        next_at = time.monotonic() + self.config.fault_every_s
        # Invariant: every fault due before now has been inflicted and its service restarted.
        while next_at < until:
            await asyncio.sleep(next_at - time.monotonic())
            kind = next(kinds)
            async with self.lock:
                began = time.monotonic()
                fault = {"t_s": round(began - self.started, 1), "kind": kind, "target": kind}
                try:
                    fault["target"] = await asyncio.to_thread(self.inflict, kind)
                except Exception as error:  # noqa: BLE001 - a restart that failed is a finding, reported
                    fault["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                self.restarts[fault["target"]] += 1
                self.faults.append({**fault, "restart_s": round(time.monotonic() - began, 2)})
            next_at += self.config.fault_every_s

    def revive(self, name: str) -> None:
        """Blocking: start again a process that exited by itself."""
        if name == "nats":
            self.stack.start_nats()
        elif name.startswith("inference-"):
            self.stack.restart_replica(name.removeprefix("inference-"), kill=False)
        else:
            self.stack.restart_service(name, kill=False)

    async def supervising(self) -> None:
        # Invariant: every process found dead so far has been recorded and started again.
        while True:
            await asyncio.sleep(2.0)
            async with self.lock:
                for proc in self.stack.dead():
                    exit_ = {"t_s": round(time.monotonic() - self.started, 1), "name": proc.name,
                             "returncode": proc.popen.returncode, "log_tail": proc.log_tail(8)}
                    self.unexpected_exits.append(exit_)
                    try:
                        await asyncio.to_thread(self.revive, proc.name)
                    except Exception as error:  # noqa: BLE001 - reported; the next pass tries again
                        exit_["revive_error"] = f"{type(error).__name__}: {str(error)[:300]}"

    async def sample(self, label: str) -> dict:
        async with self.lock:
            return await take_sample(self.stack, label, self.started)


async def soak(stack: LocalStack, config: SoakConfig, *, train_model: str | None = None) -> dict[str, Any]:
    """Run the soak on a started ``stack``; the report (samples, tallies, faults, breaches, table).
    Training jobs train ``train_model`` (the stack's first model by default)."""
    started = time.monotonic()
    load = Load(stack.url, stack.nats_url, stack.default_model, run_id=uuid.uuid4().hex[:8],
                answer_deadline_s=config.answer_deadline_s, max_tokens=config.max_tokens)
    chaos = Chaos(stack, config, started)
    # The scalarlm client ships ./ml as user code when there is one: run it where there is none.
    with contextlib.chdir(stack.state_dir):
        drivers = [asyncio.create_task(load.openai_client(config.openai_pause_s))
                   for _ in range(config.openai_clients)]
        drivers.append(asyncio.create_task(load.scalarlm_client(config.batch_size, config.batch_pause_s)))
        if config.train_every_s > 0:
            drivers.append(asyncio.create_task(
                load.trainer_client(train_model or stack.deployments[0].model, config.train_every_s)))
        if config.tinker_every_s > 0:
            drivers.append(asyncio.create_task(
                load.tinker_client(train_model or stack.deployments[0].model, config.tinker_every_s)))
        supervisor = asyncio.create_task(chaos.supervising())
        await asyncio.sleep(config.warmup_s)
        samples = [await chaos.sample("start")]
        load_ends = time.monotonic() + config.minutes * 60
        background = [supervisor]
        if config.fault_every_s > 0:
            background.append(asyncio.create_task(chaos.faulting(load_ends - config.quiet_end_s)))
        # Invariant: samples holds the start sample and one per sample_every_s passed since.
        while (left := load_ends - time.monotonic()) > 0:
            await asyncio.sleep(min(left, config.sample_every_s))
            if time.monotonic() < load_ends:
                samples.append(await chaos.sample(f"{(time.monotonic() - started) / 60:.1f} min"))
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*drivers), config.answer_deadline_s + 120)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await asyncio.sleep(config.settle_s)
        samples.append(await chaos.sample("end"))
    tallies = {kind: tally.as_dict() for kind, tally in load.tallies.items()}
    found = breaches(samples[0], samples[-1], tallies, config.limits)
    found += [f"{f['target']} at {f['t_s']:.0f} s: the restart failed ({f['error']})"
              for f in chaos.faults if "error" in f]
    return {"config": {**asdict(config), "faults": list(config.faults)},
            "duration_s": round(time.monotonic() - started, 1), "tallies": tallies, "faults": chaos.faults,
            "unexpected_exits": chaos.unexpected_exits, "samples": samples, "breaches": found,
            "table": table(samples[0], samples[-1], chaos.restarts), "trend": trend(samples)}


def trend(samples: list[dict]) -> str:
    """One line per sample: total RSS, total fds, total consumers, stream bytes, jobs and Tinker
    session workers running."""
    lines = [f"{'sample':<10}{'t s':>8}{'RSS MB':>9}{'fds':>6}{'consumers':>11}{'stream MB':>11}"
             f"{'jobs':>6}{'tinker workers':>16}"]
    for s in samples:
        procs, streams = s["processes"].values(), s["streams"].values()
        lines.append(f"{s['label']:<10}{s['t_s']:>8.0f}{sum(p['rss_mb'] for p in procs):>9.0f}"
                     f"{sum(p['fds'] for p in procs):>6}{sum(x['consumers'] for x in streams):>11}"
                     f"{sum(x['bytes'] for x in streams) / 2**20:>11.2f}{s['local_runs']['jobs']:>6}"
                     f"{s['local_runs']['tinker_workers']:>16}")
    return "\n".join(lines)


def summary(report: dict) -> str:
    """The tallies and faults, in a few lines, for the printout."""
    lines = [f"{'requests':<20}{'started':>9}{'answered':>10}{'retries':>9}{'gave up':>9}{'rejected':>10}"
             f"{'dup':>5}{'failed jobs':>13}"]
    for kind, t in report["tallies"].items():
        lines.append(f"{kind:<20}{t['started']:>9}{t['answered']:>10}{t['retries']:>9}{t['gave_up']:>9}"
                     f"{t['rejected']:>10}{t['duplicates']:>5}{t['failed_jobs']:>13}")
    lines.append("faults: " + (", ".join(f"{f['target']} at {f['t_s']:.0f} s (back in {f['restart_s']:.1f} s)"
                                          for f in report["faults"]) or "none"))
    lines.append("unexpected exits: " + (", ".join(f"{e['name']} at {e['t_s']:.0f} s (rc {e['returncode']})"
                                                   for e in report["unexpected_exits"]) or "none"))
    return "\n".join(lines)
