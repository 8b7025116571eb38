"""Preemption and exact resume: SIGTERM checkpoints and exits 143; the rerun continues bit for bit.

LoRA runs with dropout so that the result also depends on the restored RNG state.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch

from loopline.common.contracts.adapter_format import FROZEN_BASE_TYPES
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, EVENTS_FILE, STATUS_FILE, checkpoint_name
from loopline.ml.adapters.io import read_tensors
from loopline.ml.train.checkpoint import latest_checkpoint, list_checkpoints

# Tier: three training processes per adapter type.
pytestmark = pytest.mark.slow

MAX_STEPS = 20
PARAMS = {"max_steps": MAX_STEPS, "steps_per_checkpoint": 6, "max_checkpoints_to_keep": 20,
          "batch_size": 1, "gradient_accumulation_steps": 4, "learning_rate": 5e-3, "seed": 7,
          "lr_decay": "cosine", "warmup_steps": 3, "lora_config": {"lora_dropout": 0.1},
          "tokenformer_config": {"num_tokens": 16}}


def wait_for_checkpoint_event(job_dir, proc, step: int, timeout: float = 120) -> None:
    """Follow events.jsonl (reading only what is new: the machine has 2 cores to share)."""
    deadline = time.monotonic() + timeout
    path, offset, pending = job_dir / EVENTS_FILE, 0, ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training ended (rc {proc.returncode}) before step {step}'s checkpoint")
        if path.exists():
            with open(path) as f:
                f.seek(offset)
                pending += f.read()
                offset = f.tell()
            *lines, pending = pending.split("\n")
            for line in lines:
                e = json.loads(line)
                if e["kind"] == "checkpoint" and e["step"] == step:
                    return
        time.sleep(0.01)
    raise AssertionError(f"no checkpoint at step {step} within {timeout} s")


def curve(job_dir) -> list[tuple]:
    status = json.loads((job_dir / STATUS_FILE).read_text())
    return [(p["step"], p["loss"], p["epoch"]) for p in status["history"]]


@pytest.mark.parametrize("adapter_type", FROZEN_BASE_TYPES)
def test_sigterm_then_resume_equals_uninterrupted(jobs, adapter_type):
    params = {**PARAMS, "adapter_type": adapter_type}
    whole = jobs.write("whole", params)
    run = jobs.run(whole)
    assert run.returncode == 0, run.stderr[-3000:]

    cut = jobs.write("cut", params)
    proc = subprocess.Popen(jobs.command(cut), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_checkpoint_event(cut, proc, 6)
        proc.send_signal(signal.SIGTERM)  # what Slurm sends before the time limit
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    stopped_at, _ = latest_checkpoint(cut)
    assert 6 <= stopped_at < MAX_STEPS, "the run finished before the signal arrived"
    status = jobs.status(cut)
    assert status["status"] == "TRAINING" and status["step"] == stopped_at
    assert "completed" not in {e["kind"] for e in jobs.events(cut)}

    run = jobs.run(cut)  # the trainer's requeue
    assert run.returncode == 0, run.stderr[-3000:]
    assert jobs.status(cut)["status"] == "COMPLETED"
    started = [e for e in jobs.events(cut) if e["kind"] == "started"]
    assert [e["resumed_from"] for e in started] == [None, f"{CHECKPOINTS_DIR}/{checkpoint_name(stopped_at)}"]

    assert curve(cut) == curve(whole) and len(curve(whole)) == MAX_STEPS
    a, b = read_tensors(latest_checkpoint(whole)[1]), read_tensors(latest_checkpoint(cut)[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Every checkpoint the two runs share holds the same tensors, before and after the cut.
    cut_checkpoints = dict(list_checkpoints(cut))
    shared = [(step, path) for step, path in list_checkpoints(whole) if step in cut_checkpoints]
    assert len(shared) == MAX_STEPS // 6 + 1
    for step, path in shared:
        ta, tb = read_tensors(path), read_tensors(cut_checkpoints[step])
        assert all(torch.equal(ta[k], tb[k]) for k in ta), step
