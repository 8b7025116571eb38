"""Checkpoints: ``checkpoints/step-00000010/`` with the adapter files and ``training_state.pt``.

A checkpoint is written into a temp sibling folder and renamed into place, so any folder with a
checkpoint's name is complete (a reader such as the checkpoint-watcher never sees a partial one).
Old ones are renamed away before they are deleted, for the same reason. The names are
loopline.common.job_layout's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from loopline.common import adapter_format
from loopline.common.job_layout import (CHECKPOINT_TEMP_PREFIX, CHECKPOINTS_DIR, TRAINING_STATE_FILE,
                                        checkpoint_name, checkpoint_step, checkpoint_temp_prefix)
from loopline.ml.adapters.io import write_adapter

# A checkpoint being deleted: renamed away first, so no reader sees it half gone.
_TRASH_PREFIX = ".old-"
_FILES = (*adapter_format.FILES, TRAINING_STATE_FILE)


def list_checkpoints(job_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first, by step number (not by name or mtime)."""
    root = Path(job_dir) / CHECKPOINTS_DIR
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        step = checkpoint_step(path.name)
        if step is not None and all((path / f).is_file() for f in _FILES):
            found.append((step, path))
    return sorted(found)


def latest_checkpoint(job_dir: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(job_dir)
    return found[-1] if found else None


def remove_leftovers(job_dir: Path) -> None:
    """Temp and half-deleted folders of a run that was killed mid-write."""
    root = Path(job_dir) / CHECKPOINTS_DIR
    for path in root.glob(".*") if root.is_dir() else ():
        if path.name.startswith((CHECKPOINT_TEMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)


def _fsync_dir_files(folder: Path) -> None:
    # The data must be on disk before the rename publishes it, or a crash could publish empty files.
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def save_checkpoint(job_dir: Path, step: int, adapter_config: dict[str, Any],
                    tensors: dict[str, torch.Tensor], training_state: dict[str, Any], keep: int) -> Path:
    """Write ``checkpoints/step-XXXXXXXX`` atomically, then drop all but the newest ``keep``."""
    root = Path(job_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=checkpoint_temp_prefix(step), dir=root))
    try:
        write_adapter(tmp, {**adapter_config, "step": step}, tensors)
        torch.save(training_state, tmp / TRAINING_STATE_FILE)
        _fsync_dir_files(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the watcher may run as another user
        if final.exists():  # same step written by an earlier slice: replace it whole
            _discard(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in list_checkpoints(job_dir)[:-keep]:
        _discard(old)
    return final


def _discard(path: Path) -> None:
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def load_training_state(checkpoint_dir: Path) -> dict[str, Any]:
    # weights_only: the file holds only tensors and plain containers, so nothing is unpickled blindly.
    return torch.load(Path(checkpoint_dir) / TRAINING_STATE_FILE, map_location="cpu", weights_only=True)
