"""What is on disk: job directories, their complete checkpoints, and what each job adapts.

    <jobs_dir>/<job_hash>/config.json                 train_params.JobConfig: the served model it adapts
    <jobs_dir>/<job_hash>/checkpoints/step-%08d/      complete: the training program renames it in
    <jobs_dir>/<job_hash>/checkpoints/.tmp-step-…/    being written: never looked at

The names are loopline.common.contracts.job_layout's. Names starting with "." are someone's work in progress
(the trainer's .staging-*, the local launcher's .local-runs, the training program's .tmp-* and
.old-*), and none is a job hash or a checkpoint name. Blocking calls: run them in a thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loopline.common.contracts.job_hash import is_job_hash
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, CONFIG_FILE, checkpoint_step
from loopline.common.contracts.train_params import JobConfig

# A config.json is a few hundred bytes; one larger than this (a job's code may write its own
# directory) is not read whole.
MAX_CONFIG_BYTES = 1024 * 1024


@dataclass(frozen=True)
class StepDir:
    step: int
    path: Path
    # Inode and mtime of the folder: a step written again (a resumed run replaces it whole) is a
    # new folder, so a new fingerprint; the same folder seen after a restart has the same one.
    fingerprint: str
    created_at: float  # the folder's mtime: when its last file was written, just before the rename


@dataclass(frozen=True)
class WatchedJob:
    # Inode of the job directory and mtime of its config.json: a job deleted and submitted again
    # (same hash) is a new directory and starts over from step 0.
    identity: str
    base_model: str  # the served model name the job adapts: <base> of checkpoints.<base>.<hash>


def job_names(jobs_dir: Path) -> list[str]:
    try:
        entries = list(os.scandir(jobs_dir))
    except FileNotFoundError:
        return []
    # The job hash becomes a subject token and a KV key: anything else in jobs_dir is not a job.
    return sorted(e.name for e in entries if is_job_hash(e.name) and e.is_dir(follow_symlinks=False))


def step_dirs(job_dir: Path) -> list[StepDir]:
    """The job's complete checkpoints, oldest first (by step number); none when the job is gone."""
    found = []
    try:
        entries = list(os.scandir(job_dir / CHECKPOINTS_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        step = checkpoint_step(entry.name)
        if step is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # rotated away while we listed
        if entry.is_dir(follow_symlinks=False):
            found.append(StepDir(step, Path(entry.path), f"{st.st_ino}-{st.st_mtime_ns}",
                                 st.st_mtime))
    return sorted(found, key=lambda s: s.step)


def watched_job(job_dir: Path) -> WatchedJob | None:
    """None when config.json is missing or not a JobConfig: not a job of ours, or one being
    deleted."""
    try:
        dir_ino = job_dir.stat().st_ino
        with open(job_dir / CONFIG_FILE, "rb") as f:
            config_mtime = os.fstat(f.fileno()).st_mtime_ns
            config = JobConfig.model_validate_json(f.read(MAX_CONFIG_BYTES))
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return None
    if not config.served_model:
        return None
    return WatchedJob(identity=f"{dir_ino}-{config_mtime}", base_model=config.served_model)
