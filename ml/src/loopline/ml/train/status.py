"""What the trainer reads from the job directory: status.json (rewritten) and events.jsonl (appended).

status.json is replaced atomically (atomic_files.write_atomic), so a reader sees the old or the new
file, never half of one. events.jsonl gets one JSON object per line, flushed as it is written.
Times: ``time``, ``started_at``, ``updated_at``, ``created_at`` are Unix seconds; a history
point's ``time`` is seconds of training so far (``accumulated_train_seconds``), as in ScalarLM.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from loopline.common.atomic_files import write_atomic
from loopline.common.contracts.job_layout import EVENTS_FILE, STATUS_FILE

HISTORY_LIMIT = 1024  # ScalarLM's training_history_length


def finite_or_none(x: float | None) -> float | None:
    # JSON has no NaN/inf (Python would write invalid JSON): a non-finite loss is written as null.
    return x if x is not None and math.isfinite(x) else None


def thin(history: list[dict], limit: int = HISTORY_LIMIT) -> list[dict]:
    """Halve the history once it is over ``limit``, always keeping the newest point."""
    while len(history) > limit:
        history = history[(len(history) - 1) % 2::2]
    return history


def read_status(job_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(job_dir) / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class JobReporter:
    """Owns status.json and events.jsonl for one run (one Slurm slice) of a job."""

    def __init__(self, job_dir: Path):
        self.job_dir = Path(job_dir)
        previous = read_status(self.job_dir) or {}
        now = time.time()
        # Until the run knows where it resumes, it shows what the previous slice left (so a slice
        # that fails during set-up does not wipe the job's curve). Keys we do not own (e.g. written
        # by the trainer before launch) are kept.
        self.status: dict[str, Any] = {
            **previous,
            "status": "TRAINING",
            "step": previous.get("step", 0),
            "max_steps": previous.get("max_steps", 0),
            "epoch": previous.get("epoch", 0.0),
            "loss": previous.get("loss"),
            "history": previous.get("history") or [],
            # The first slice's start survives requeues; so does the time trained so far.
            "started_at": previous.get("started_at") or now,
            "updated_at": now,
            "error": None,
            "accumulated_train_seconds": float(previous.get("accumulated_train_seconds") or 0.0),
            "skipped_steps": previous.get("skipped_steps", 0),
        }
        # Open for the reporter's life (one event per step); close() closes it.
        self._events = open(self.job_dir / EVENTS_FILE, "a", encoding="utf-8")  # noqa: SIM115

    def resume_from(self, step: int, epoch: float, skipped_steps: int) -> None:
        """Keep the history up to the checkpoint we resume from; later points will be redone."""
        history = [p for p in self.status["history"] if p.get("step", 0) <= step]
        last_loss = history[-1]["loss"] if history else None
        self.status.update(step=step, epoch=epoch, history=history, loss=last_loss,
                           skipped_steps=skipped_steps)

    def event(self, kind: str, **fields: Any) -> None:
        self._events.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")
        self._events.flush()

    def write(self, **changes: Any) -> None:
        self.status.update(changes, updated_at=time.time())
        write_atomic(self.job_dir / STATUS_FILE, json.dumps(self.status, indent=1) + "\n")

    def step(self, *, step: int, loss: float | None, learning_rate: float, tokens_per_s: float,
             epoch: float, train_seconds: float, skipped_steps: int, grad_norm: float) -> None:
        loss = finite_or_none(loss)
        history = self.status["history"]
        if loss is not None:  # a skipped (non-finite) step has no point on the curve
            history = thin([*history, {"step": step, "loss": loss, "epoch": epoch, "time": train_seconds}])
        self.write(step=step, epoch=epoch, loss=loss, history=history, skipped_steps=skipped_steps,
                   accumulated_train_seconds=train_seconds)
        self.event("progress", step=step, max_steps=self.status["max_steps"], loss=loss,
                   learning_rate=learning_rate, tokens_per_s=tokens_per_s, epoch=epoch,
                   grad_norm=finite_or_none(grad_norm), accumulated_train_seconds=train_seconds,
                   skipped_steps=skipped_steps)

    def close(self) -> None:
        self._events.close()
