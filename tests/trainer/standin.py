"""A stand-in for ``python -m loopline.ml.train --job-dir DIR`` in the trainer's (and the gateway's)
tests: the training program with its training loop swapped for a few sleeps, so a job runs in a
fraction of a second without torch.

Product code, so it cannot drift from what the real program does to the job directory:
  - the program around the loop (``loopline.ml.train.__main__.run_program``): SIGTERM asks the loop
    to stop, an exception ends the job FAILED with a ``failed`` event naming it;
  - config.json read by ``JobConfig``; status.json and events.jsonl written by ``JobReporter``
    (resume_from, step, write, event) as ``loop.run_job`` does;
  - checkpoints published, pruned and found by ``checkpoint_folders`` (temp folder, rename into
    ``checkpoints/step-%08d``, keep the newest ``max_checkpoints_to_keep``, resume from the newest).
Stand-in: ``run_standin`` in place of ``loop.run_job`` (its step is a sleep, its loss 1/(step+1), and
its checkpoint files hold a line of JSON, not tensors), and the switches below.

Params it reads, besides TrainParams' max_steps, steps_per_checkpoint, max_checkpoints_to_keep:
  standin_step_s   seconds per step (default 0.05)
  standin_start_s  seconds before the first write, as a model loads (default 0): the job stays QUEUED
  standin_fail     raise "<Name>: <message>" once started (the job FAILED with exactly that error)
  standin_crash    exit 1 at once, writing nothing (a broken environment)
Each start appends "start <step> rank <rank>/<world>" to DIR/runs.txt, so a test can see resumption,
and prints its progress to stdout (the launcher's log of the run). Only rank 0 writes the job's
files when it runs as several ranks (srun or torchrun), as loopline.ml.parallel does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from loopline.common.contracts.train_params import JobConfig
from loopline.ml.train.__main__ import run_program
from loopline.ml.train.checkpoint_folders import (
    CHECKPOINT_FILES,
    latest_checkpoint,
    publish_checkpoint,
    remove_leftovers,
)
from loopline.ml.train.exit_codes import EXIT_COMPLETED, EXIT_PREEMPTED
from loopline.ml.train.status import JobReporter

RUNS_FILE = "runs.txt"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-dir", type=Path, required=True)
    job_dir = parser.parse_args().job_dir
    extra = JobConfig.read(job_dir).params.model_extra or {}
    if extra.get("standin_crash"):
        print("standin: crashing on purpose", flush=True)
        return 1
    if rank_and_world()[0] != 0:
        return follow_along(job_dir)
    return run_program(job_dir, run_standin)


def rank_and_world() -> tuple[int, int]:
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
    return rank, int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", "1")))


def note_start(job_dir: Path, step: int) -> None:
    rank, world = rank_and_world()
    with open(job_dir / RUNS_FILE, "a") as runs:
        runs.write(f"start {step} rank {rank}/{world}\n")
    print(f"standin rank {rank}/{world}: starting at step {step}", flush=True)


def follow_along(job_dir: Path) -> int:
    """A rank other than 0: steps in time with rank 0 and writes nothing but its start."""
    stop = {"term": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(term=True))
    p = JobConfig.read(job_dir).params
    found = latest_checkpoint(job_dir)
    step = found[0] if found else 0
    note_start(job_dir, step)
    # Invariant: `step` steps are done; a SIGTERM ends the run before the next one.
    while step < p.max_steps and not stop["term"]:
        time.sleep(float((p.model_extra or {}).get("standin_step_s", 0.05)))
        step += 1
    return EXIT_PREEMPTED if stop["term"] else EXIT_COMPLETED


def run_standin(job_dir: Path, config: JobConfig, reporter: JobReporter,
                stop_requested: Callable[[], bool]) -> int:
    """What ``loop.run_job`` does to the job directory, with a sleep for each step."""
    p = config.params
    extra = p.model_extra or {}
    step_s = float(extra.get("standin_step_s", 0.05))
    reporter.status["max_steps"] = p.max_steps
    remove_leftovers(job_dir)
    resumed_from = latest_checkpoint(job_dir)
    step = resumed_from[0] if resumed_from else 0
    note_start(job_dir, step)
    loaded_at = time.monotonic() + float(extra.get("standin_start_s", 0))
    # Invariant: nothing of this run is in status.json or events.jsonl yet; a SIGTERM ends the wait
    # (then the loop below makes no step, as the real one when TERM comes while its model loads).
    while time.monotonic() < loaded_at and not stop_requested():
        time.sleep(min(0.05, max(0.0, loaded_at - time.monotonic())))
    if extra.get("standin_fail"):
        name, _, message = str(extra["standin_fail"]).partition(": ")
        raise type(name, (Exception,), {})(message)  # run_program reports it as "<name>: <message>"

    reporter.resume_from(step, 0.0, 0)
    reporter.write(status="TRAINING", error=None)
    reporter.event("started", step=step, max_steps=p.max_steps, adapter_type=p.adapter_type,
                   resumed_from=str(resumed_from[1].relative_to(job_dir)) if resumed_from else None)

    def save() -> None:
        def write(folder: Path) -> None:
            for name in CHECKPOINT_FILES:
                (folder / name).write_text(json.dumps({"step": step, "standin": True}) + "\n")

        path = publish_checkpoint(job_dir, step, write, p.max_checkpoints_to_keep)
        reporter.event("checkpoint", step=step, path=str(path.relative_to(job_dir)), created_at=time.time())

    last_checkpoint = step
    # Invariant: `step` steps are done and reported; a checkpoint holds every multiple of
    # steps_per_checkpoint up to it.
    while step < p.max_steps and not stop_requested():
        time.sleep(step_s)
        step += 1
        reporter.step(step=step, loss=1.0 / (step + 1), learning_rate=0.001, tokens_per_s=0.0, epoch=0.0,
                      train_seconds=step * step_s, skipped_steps=0, grad_norm=0.0)
        print(f"standin: step {step} of {p.max_steps}", flush=True)
        if step % p.steps_per_checkpoint == 0 or step == p.max_steps:
            save()
            last_checkpoint = step

    if step < p.max_steps:
        if step > last_checkpoint:
            save()
        reporter.write(status="TRAINING")
        print(f"standin: SIGTERM, checkpointed at step {step}", flush=True)
        return EXIT_PREEMPTED
    reporter.write(status="COMPLETED")
    reporter.event("completed", step=step, loss=reporter.status["loss"])
    print("standin: completed", flush=True)
    return EXIT_COMPLETED


if __name__ == "__main__":
    sys.exit(main())
