"""A stand-in for ``python -m loopline.ml.train --job-dir DIR`` in the trainer's tests: it keeps the
training program's job-directory contract (reads config.json; writes status.json atomically,
appends events.jsonl, renames checkpoints/step-%08d into place, resumes from the newest one, and on
SIGTERM checkpoints, leaves status TRAINING and exits 143) without torch, in a fraction of a second.

Params it reads (besides max_steps and steps_per_checkpoint):
  standin_step_s   seconds per step (default 0.05)
  standin_fail     fail at step 1 with this error (status FAILED, a failed event, exit 1)
  standin_crash    exit 1 at once, writing nothing (a broken environment)
Each start appends "start <step> rank <rank>/<world>" to DIR/runs.txt, so a test can see resumption.
Only rank 0 writes the job's files when it runs as several ranks (srun or torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from loopline.common.job_layout import (CHECKPOINTS_DIR, CONFIG_FILE, EVENTS_FILE, STATUS_FILE,
                                        checkpoint_name, checkpoint_step, checkpoint_temp_prefix)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-dir", type=Path, required=True)
    job_dir = parser.parse_args().job_dir
    stop = {"term": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(term=True))

    params = json.loads((job_dir / CONFIG_FILE).read_text())["params"]
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
    world = int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", "1")))
    max_steps = int(params.get("max_steps", 5))
    every = int(params.get("steps_per_checkpoint", 2))
    step_s = float(params.get("standin_step_s", 0.05))
    if params.get("standin_crash"):
        print("standin: crashing on purpose", flush=True)
        return 1

    checkpoints = job_dir / CHECKPOINTS_DIR
    found = (checkpoint_step(p.name) for p in checkpoints.iterdir()) if checkpoints.is_dir() else ()
    done = sorted(step for step in found if step is not None)
    step = done[-1] if done else 0
    with open(job_dir / "runs.txt", "a") as runs:
        runs.write(f"start {step} rank {rank}/{world}\n")
    print(f"standin rank {rank}/{world}: starting at step {step} of {max_steps}", flush=True)
    if rank != 0:
        while step < max_steps and not stop["term"]:
            time.sleep(step_s)
            step += 1
        return 143 if stop["term"] else 0

    previous = _read(job_dir / STATUS_FILE)
    status = {
        "status": "TRAINING", "step": step, "max_steps": max_steps, "epoch": 0.0,
        "loss": None, "started_at": previous.get("started_at") or time.time(), "error": None,
        "history": [p for p in previous.get("history", []) if p["step"] <= step],
    }

    def write_status(**changes) -> None:
        status.update(changes, updated_at=time.time())
        tmp = job_dir / f".{STATUS_FILE}.tmp"
        tmp.write_text(json.dumps(status))
        os.replace(tmp, job_dir / STATUS_FILE)

    def event(kind: str, **fields) -> None:
        with open(job_dir / EVENTS_FILE, "a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")

    def checkpoint() -> None:
        final = checkpoints / checkpoint_name(step)
        if final.exists():
            return
        tmp = checkpoints / checkpoint_temp_prefix(step)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "state.json").write_text(json.dumps({"step": step}))
        os.replace(tmp, final)
        event("checkpoint", step=step, path=f"{CHECKPOINTS_DIR}/{final.name}", created_at=time.time())

    if params.get("standin_fail"):
        write_status(status="FAILED", error=params["standin_fail"])
        event("failed", step=step, error=params["standin_fail"])
        return 1

    write_status()
    event("started", step=step, max_steps=max_steps)
    while step < max_steps:
        if stop["term"]:
            checkpoint()
            write_status(status="TRAINING")
            print("standin: SIGTERM, checkpointed", flush=True)
            return 143
        time.sleep(step_s)
        step += 1
        loss = 1.0 / (step + 1)
        status["history"].append({"step": step, "loss": loss, "epoch": 0.0, "time": step * step_s})
        write_status(step=step, loss=loss)
        event("progress", step=step, max_steps=max_steps, loss=loss, learning_rate=0.001, epoch=0.0)
        if step % every == 0:
            checkpoint()
    write_status(status="COMPLETED")
    event("completed", step=step, loss=status["loss"])
    print("standin: completed", flush=True)
    return 0


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
