"""What the chaos tests share for training jobs: a small job submitted through the scalarlm client,
its end awaited, the test's own look at what NATS holds of it (every checkpoint announcement, every
job event) and at its training program (found in /proc, killed, counted), and what its events must
show after any fault (``check_runs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
from nats.js.api import ConsumerConfig, DeliverPolicy

from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, EVENTS_FILE, checkpoint_step
from loopline.common.local.stack import LocalStack
from support.chaos import assert_answered_once, openai_load

FINISHED_JOB = {"COMPLETED", "FAILED", "CANCELLED"}

# One checkpoint a step: a kill loses at most the step it interrupted.
TRAIN_ARGS = {"learning_rate": 1e-2, "batch_size": 2, "gradient_accumulation_steps": 1,
              "steps_per_checkpoint": 1}


async def train(stack: LocalStack, model: str, tag: str, max_steps: int) -> str:
    """Submit a small job through the scalarlm client; its hash. Run from the stack's state folder,
    which holds no ``ml/`` (the client would ship it as user code)."""
    import scalarlm

    llm = scalarlm.SupermassiveIntelligence(api_url=stack.url)
    data = [{"input": f"Chaos {tag} question {i}?", "output": f" Answer {i}."} for i in range(4)]
    with contextlib.chdir(stack.state_dir):
        reply = await asyncio.to_thread(llm.train, data, model_name=model,
                                        train_args={**TRAIN_ARGS, "max_steps": max_steps})
    return reply["job_status"]["model_name"]


async def wait_job(url: str, job_hash: str, timeout_s: float = 240) -> dict:
    """The job's status once it ended, as the gateway tells it."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        # Invariant: every earlier look found the job unfinished (or the gateway busy).
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                status = (await http.get(f"/v1/megatron/train/{job_hash}")).json()["job_status"]
                if status["status"] in FINISHED_JOB:
                    return status
            await asyncio.sleep(0.5)
    raise AssertionError(f"job {job_hash} did not finish in {timeout_s} s")


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    # Invariant: predicate() was false at every earlier look.
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not seen in {timeout_s} s"
        await asyncio.sleep(0.05)


def checkpoint_steps(job_dir: Path) -> list[int]:
    """The complete checkpoints on disk (the program keeps the last few)."""
    try:
        names = os.listdir(job_dir / CHECKPOINTS_DIR)
    except FileNotFoundError:
        return []
    return sorted(step for step in map(checkpoint_step, names) if step is not None)


class RunWatch:
    """Samples, every 50 ms while it is open, how many training programs of a job are running it:
    have its events.jsonl open, which a run does from its start to its end (one merely started,
    waiting for the run before it to end, does not yet)."""

    def __init__(self, job_dir: Path):
        self.job_dir = job_dir
        self.most_at_once = 0
        self.task: asyncio.Task | None = None

    async def _sample(self) -> None:
        # Invariant: most_at_once is the largest count seen so far.
        while True:
            count = len(await asyncio.to_thread(running_pids, self.job_dir))
            self.most_at_once = max(self.most_at_once, count)
            await asyncio.sleep(0.05)

    async def __aenter__(self) -> RunWatch:
        self.task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *_exc) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def check_runs(events: list[dict], max_steps: int) -> list[list[int]]:
    """What a job's published events must show after any fault, with one checkpoint a step: each
    event once (seq 1, 2, 3… with no copy or gap), one ``completed``, and each run (from one
    ``started`` to the next) reporting its steps once, in order, from the checkpoint it resumed at,
    having lost at most the one step the run before it was killed in. The progress steps of each run."""
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(events) + 1)), f"an event published twice or skipped: {seqs}"
    kinds = [e["kind"] for e in events]
    assert kinds.count("completed") == 1 and kinds[-1] == "completed", kinds
    starts = [i for i, kind in enumerate(kinds) if kind == "started"]
    assert starts, kinds
    runs, reached = [], 0
    # Invariant: runs holds the progress steps of each run before this one; reached is the last
    # step the run before reported.
    for number, (begin, end) in enumerate(zip(starts, [*starts[1:], len(events)], strict=True)):
        resumed_at = events[begin]["step"]
        steps = progress_steps(events[begin:end])
        if number == 0:
            assert resumed_at == 0, events[begin]
        else:
            assert reached - 1 <= resumed_at <= reached, f"run {number} resumed at {resumed_at} ({reached})"
        assert steps == list(range(resumed_at + 1, resumed_at + 1 + len(steps))), steps
        runs.append(steps)
        reached = steps[-1] if steps else resumed_at
    assert reached == max_steps, runs
    return runs


@dataclass
class Announcement:
    job_hash: str
    step: int
    sha256: str
    at: float  # time.monotonic() when the test saw it


class CheckpointTap:
    """Every announcement published on CHECKPOINTS while it listens (the stream keeps one per job;
    a core subscription sees each publish)."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.seen: list[Announcement] = []
        self.nc: nats.NATS | None = None

    async def __aenter__(self) -> CheckpointTap:
        self.nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1)

        async def on_message(msg) -> None:
            data = json.loads(msg.data)
            self.seen.append(Announcement(data["job_hash"], data["step"], data["sha256"], time.monotonic()))

        await self.nc.subscribe(subjects.CHECKPOINTS_ALL, cb=on_message)
        await self.nc.flush()
        return self

    async def __aexit__(self, *_exc) -> None:
        assert self.nc is not None
        await self.nc.close()

    def of(self, job_hash: str) -> list[Announcement]:
        return [a for a in self.seen if a.job_hash == job_hash]


async def job_events(nats_url: str, job_hash: str) -> list[dict]:
    """Every message the EVENTS stream holds for the job, in stream order (copies included: this is
    what was published, not what a reader deduplicated)."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(subjects.EVENTS_STREAM, subjects_filter=subjects.job_events(job_hash))
        total = sum((info.state.subjects or {}).values())
        sub = await js.pull_subscribe(subjects.job_events(job_hash), stream=subjects.EVENTS_STREAM,
                                      config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        events: list[dict] = []
        try:
            # Invariant: events holds the first len(events) of the job's messages, in order.
            while len(events) < total:
                for msg in await sub.fetch(min(256, total - len(events)), timeout=10):
                    events.append(json.loads(msg.data))
                    await msg.ack()
        finally:
            await sub.unsubscribe()
        return events
    finally:
        await nc.close()


def training_pids(job_dir: Path) -> list[int]:
    """The job's training program (``python -m loopline.ml.train --job-dir <job_dir>``), found in
    /proc: under the local launcher and under Slurm alike it runs on this machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended while we looked
        if b"loopline.ml.train" in argv and str(job_dir).encode() in argv:
            pids.append(int(entry.name))
    return pids


def running_pids(job_dir: Path) -> list[int]:
    """The job's training programs that have its events.jsonl open (are running it)."""
    events = str(job_dir / EVENTS_FILE)
    running = []
    for pid in training_pids(job_dir):
        with contextlib.suppress(OSError):  # ended while we looked
            fds = Path(f"/proc/{pid}/fd")
            if any(os.readlink(fd) == events for fd in fds.iterdir()):
                running.append(pid)
    return running


def kill_training(job_dir: Path) -> list[int]:
    """``kill -9`` the job's training program alone (not the trainer, not its launcher's wrapper);
    the pids killed."""
    pids = training_pids(job_dir)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def progress_steps(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["kind"] == "progress"]


async def kill_a_training_process(stack: LocalStack, model: str, rng: random.Random, *, launches: int,
                                  max_steps: int = 40, kill_by_step: int = 8) -> None:
    """Under a light OpenAI load, ``kill -9`` a job's training program (not the trainer) a random
    moment after a random step; the trainer launches it again, it resumes from its last checkpoint
    (one a step: at most one step lost) and completes; its events are each published once.
    ``launches``: how many runs the job must have had (the launcher's semantics decide)."""
    stop = asyncio.Event()
    load = asyncio.create_task(openai_load(stack.url, stack.default_model, stop, max_tokens=16))
    job_hash = await train(stack, model, f"process {rng.random()}", max_steps)
    job_dir = stack.jobs_dir / job_hash
    # Early, so that the job is still running up to 0.5 s later: a step takes 0.04-0.3 s, and with
    # 12 steps, killed after step 8 or fewer, the program had finished before the kill once
    # (2026-11-28, idle machine: one run, steps 1-12).
    kill_after = rng.randint(2, kill_by_step)
    async with RunWatch(job_dir) as runs_at_once:
        await wait_for(lambda: max(checkpoint_steps(job_dir), default=0) >= kill_after, 180,
                       f"checkpoint {kill_after}")
        await asyncio.sleep(rng.uniform(0.0, 0.5))  # somewhere inside a step, or between two
        killed = kill_training(job_dir)
        assert killed, "no training program found"
        status = await wait_job(stack.url, job_hash)
    stop.set()
    answers = await asyncio.wait_for(load, 240)

    assert status["status"] == "COMPLETED", status
    assert runs_at_once.most_at_once == 1, "two training programs of one job ran at once"
    runs = check_runs(await job_events(stack.nats_url, job_hash), max_steps)
    print(f"killed {killed} after step {kill_after}+; steps by run: {runs}")
    assert len(runs) == launches, runs
    assert_answered_once(answers)
