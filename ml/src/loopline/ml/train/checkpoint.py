"""Checkpoints: ``checkpoints/step-00000010/`` with the adapter files and ``training_state.pt``.

What goes into one (the adapter through loopline.ml.adapters.io, the training state through
torch.save) and reading the state back. How a folder is published (temp folder, fsync, rename into
place), listed and pruned is checkpoint_folders.py's, which needs no torch; its functions are
re-exported here so the training loops import one module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loopline.common.contracts.job_layout import TRAINING_STATE_FILE
from loopline.ml.adapters.io import write_adapter

from .checkpoint_folders import (
    CHECKPOINT_FILES,
    latest_checkpoint,
    list_checkpoints,
    publish_checkpoint,
    remove_leftovers,
)

__all__ = ["CHECKPOINT_FILES", "latest_checkpoint", "list_checkpoints", "load_training_state",
           "publish_checkpoint", "remove_leftovers", "save_checkpoint"]


def save_checkpoint(job_dir: Path, step: int, adapter_config: dict[str, Any],
                    tensors: dict[str, torch.Tensor], training_state: dict[str, Any], keep: int) -> Path:
    """Write ``checkpoints/step-XXXXXXXX`` atomically, then drop all but the newest ``keep``."""

    def write(folder: Path) -> None:
        write_adapter(folder, {**adapter_config, "step": step}, tensors)
        torch.save(training_state, folder / TRAINING_STATE_FILE)

    return publish_checkpoint(job_dir, step, write, keep)


def load_training_state(checkpoint_dir: Path) -> dict[str, Any]:
    # weights_only: the file holds only tensors and plain containers, so nothing is unpickled blindly.
    return torch.load(Path(checkpoint_dir) / TRAINING_STATE_FILE, map_location="cpu", weights_only=True)
