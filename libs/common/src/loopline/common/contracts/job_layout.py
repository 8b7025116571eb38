"""The job directory: the names every part that reads or writes one agrees on.

    <jobs_dir>/<job_hash>/
        config.json          train_params.JobConfig                        (trainer; session worker *)
        dataset.jsonlines    the training data, from the datasets store    (trainer)
        ml/                  the job's own code, only when allowed         (trainer)
        status.json          status, step, loss history                    (training program)
        events.jsonl         one event per line, appended                  (both, O_APPEND)
        checkpoints/step-%08d/                                             (training program)
            adapter_config.json, adapter_model.safetensors   (adapter_format)
            training_state.pt                                optimizer, scheduler, data order, RNG
        .run.lock            locked (POSIX) by the run writing the folder  (training program)

    <jobs_dir>/.control/<job_hash>/    the trainer's alone (0700): the job's code cannot write it
        entrypoint.sh        what sbatch (or the local launcher) runs      (trainer)
        secret.env           a session worker's credential, 0600           (trainer)
        slurm-<id>.out, local-<id>.out   one log per allocation           (launcher, Slurm)

A job whose own ``ml/`` code runs owns its folder (a uid of its own, mode 2750, the trainer's
group): every name in it may be a link the code planted, so the trainer opens none by following one.

* A Tinker sampler save is laid out as a job (tinker_names): the session worker writes its
config.json and its one checkpoint.

A checkpoint is written into ``.tmp-step-%08d-*`` beside the others and renamed into place
(atomic_files), so a folder with a checkpoint name is complete. Names starting with "." are always
someone's work in progress, never looked at by a reader. The job hash itself is ``job_hash.py``'s.

Standard library only: the training program imports it inside a Slurm job.
"""

from __future__ import annotations

import re

CONFIG_FILE = "config.json"
DATASET_FILE = "dataset.jsonlines"
CODE_DIR = "ml"
ENTRYPOINT_FILE = "entrypoint.sh"
STATUS_FILE = "status.json"
EVENTS_FILE = "events.jsonl"
CHECKPOINTS_DIR = "checkpoints"
TRAINING_STATE_FILE = "training_state.pt"
# One run of a job writes its folder at a time: a run starting while the one before still runs (a
# node declared down with its program alive, a cancelled run still checkpointing) waits for it.
RUN_LOCK_FILE = ".run.lock"

# Written with 8 digits, read with 8 or more: a step past 99,999,999 still names its checkpoint,
# and "step-7" (hand-made, or another tool's) is not one of ours.
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")
# A checkpoint being written; readers skip every name starting with ".".
CHECKPOINT_TEMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint after ``step`` optimizer steps, inside ``checkpoints/``."""
    return f"step-{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step a checkpoint folder's name says, or None when the name is no checkpoint's."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def checkpoint_temp_prefix(step: int) -> str:
    """The name prefix of the folder a checkpoint is written in before its rename into place."""
    return f"{CHECKPOINT_TEMP_PREFIX}{checkpoint_name(step)}-"
