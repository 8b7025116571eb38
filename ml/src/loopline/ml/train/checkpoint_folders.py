"""Checkpoint folders, without torch: publish one atomically, list the complete ones, keep the newest
few, clear what a killed run left half written.

A checkpoint is written into a temp sibling folder (``job_layout.checkpoint_temp_prefix``) and
renamed into place, so any folder with a checkpoint's name is complete: a reader such as the
checkpoint-watcher never sees a partial one. Old ones are renamed away before they are deleted, for
the same reason. What goes inside is the caller's: ``checkpoint.save_checkpoint`` writes the adapter
and the training state through ``publish_checkpoint``, and so does the trainer tests' stand-in
program with small files of its own (no torch to import, so each of its runs starts in a blink).
The names are loopline.common.contracts.job_layout's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from loopline.common.atomic_files import atomic_dir
from loopline.common.contracts import adapter_format
from loopline.common.contracts.job_layout import (
    CHECKPOINT_TEMP_PREFIX,
    CHECKPOINTS_DIR,
    TRAINING_STATE_FILE,
    checkpoint_name,
    checkpoint_step,
    checkpoint_temp_prefix,
)

# A checkpoint being deleted: renamed away first, so no reader sees it half gone.
_TRASH_PREFIX = ".old-"
# What a complete checkpoint holds: the adapter (adapter_format) and the state to resume from.
CHECKPOINT_FILES = (*adapter_format.FILES, TRAINING_STATE_FILE)


def list_checkpoints(job_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first, by step number (not by name or mtime)."""
    root = Path(job_dir) / CHECKPOINTS_DIR
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        step = checkpoint_step(path.name)
        if step is not None and all((path / f).is_file() for f in CHECKPOINT_FILES):
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


def publish_checkpoint(job_dir: Path, step: int, write: Callable[[Path], None], keep: int) -> Path:
    """Have ``write(folder)`` fill a temp folder with ``CHECKPOINT_FILES``, rename it into place as
    ``checkpoints/step-XXXXXXXX``, then drop all but the newest ``keep``. Returns the new folder."""
    final = Path(job_dir) / CHECKPOINTS_DIR / checkpoint_name(step)
    # 0755: the watcher may run as another user. The same step written by an earlier slice is
    # replaced whole.
    with atomic_dir(final, temp_prefix=checkpoint_temp_prefix(step)) as tmp:
        write(tmp)
        _fsync_dir_files(tmp)
    for _, old in list_checkpoints(job_dir)[:-keep]:
        _discard(old)
    return final


def _fsync_dir_files(folder: Path) -> None:
    # The data must be on disk before the rename publishes it, or a crash could publish empty files.
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _discard(path: Path) -> None:
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
