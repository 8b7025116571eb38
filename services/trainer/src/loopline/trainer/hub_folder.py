"""What a job is pushed to the Hub as: the files of its newest checkpoint, laid out so that the usual
loader takes the folder as it is.

  lora         adapter_config.json + adapter_model.safetensors: already PEFT's own format
               (docs/adapter-format.md), so ``PeftModel.from_pretrained`` loads it;
  none         model.safetensors (the checkpoint's every weight, under the model's own names) beside
               the base model's config, generation config and tokenizer files, so
               ``AutoModelForCausalLM.from_pretrained`` loads it;
  tokenformer  the checkpoint's two files as they are (loopline.ml applies them).
training_state.pt (optimizer state) is never pushed. ``base_model_name_or_path`` in the config names
the served model rather than this server's folder.

The checkpoint is in a folder the job's code may write: every name on the way to its files, and the
files, are opened without following a link (nofollow.py), so a planted link cannot make the trainer
upload a file of its own. Files are handed over open, not by path, for the same reason.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from loopline.common.contracts import adapter_format
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR
from loopline.trainer import jobdir, nofollow
from loopline.trainer.registry import Job

# A model folder's own files (transformers' CONFIG_NAME and SAFE_WEIGHTS_NAME), for a full fine-tune.
MODEL_CONFIG_FILE = "config.json"
MODEL_WEIGHTS_FILE = "model.safetensors"
# adapter_config.json is a few kB; anything near this is not one.
MAX_CONFIG_BYTES = 1 << 20
# Files of the base model's folder that are weights (or the folder's own card), not pushed with a
# full fine-tune, whose weights replace them.
BASE_SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx",
                         ".index.json")
BASE_SKIPPED_NAMES = ("README.md", ".gitattributes")
MAX_BASE_FILE_BYTES = 64 << 20  # a tokenizer.json is a few MB

Files = dict[str, bytes | BinaryIO]  # path in the repo -> its content


class NothingToPush(Exception):
    """The job left nothing that can be pushed (no checkpoint, a broken one, no base folder)."""


def newest_checkpoint(job: Job) -> tuple[int, str]:
    found = jobdir.checkpoints(job.job_dir)
    if not found:
        raise NothingToPush("the job left no checkpoint")
    step, relative, _ = found[-1]
    return step, Path(relative).name


def checkpoint_files(job: Job, checkpoint: str, stack: contextlib.ExitStack) -> Files:
    """The files to push for the checkpoint folder named ``checkpoint`` (in ``checkpoints/``), open
    until ``stack`` closes."""
    with _checkpoint_folder(job.job_dir, checkpoint) as dir_fd:
        config = _adapter_config(dir_fd)
        weights = stack.enter_context(_open(dir_fd, adapter_format.WEIGHTS_FILE))
    config["base_model_name_or_path"] = job.llm_name
    config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    if job.adapter_type != adapter_format.FULL_WEIGHTS:
        return {adapter_format.CONFIG_FILE: config_bytes, adapter_format.WEIGHTS_FILE: weights}
    return {**_base_model_files(job), MODEL_WEIGHTS_FILE: weights}


@contextlib.contextmanager
def _checkpoint_folder(job_dir: Path, checkpoint: str) -> Iterator[int]:
    """``<job_dir>/checkpoints/<checkpoint>`` opened one name at a time, none through a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    with nofollow.folder(job_dir) as job_fd:
        try:
            parent = os.open(CHECKPOINTS_DIR, flags, dir_fd=job_fd)
        except OSError as exc:
            raise NothingToPush(f"{CHECKPOINTS_DIR}/ cannot be opened as a folder: {exc.strerror}") from exc
    try:
        try:
            fd = os.open(checkpoint, flags, dir_fd=parent)
        except OSError as exc:
            raise NothingToPush(f"{checkpoint} cannot be opened as a folder: {exc.strerror}") from exc
    finally:
        os.close(parent)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _open(dir_fd: int, name: str) -> Iterator[BinaryIO]:
    try:
        fd = nofollow.open_file(dir_fd, name)
    except OSError as exc:  # missing, or a link, FIFO, hard link (NotAFile)
        raise NothingToPush(f"the checkpoint's {name} cannot be read: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as f:
        yield f


def _adapter_config(dir_fd: int) -> dict:
    with _open(dir_fd, adapter_format.CONFIG_FILE) as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    try:
        config = json.loads(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise NothingToPush(f"the checkpoint's {adapter_format.CONFIG_FILE} is not a JSON object of "
                            f"at most {MAX_CONFIG_BYTES} bytes")
    return config


def _base_model_files(job: Job) -> Files:
    """The base model folder's config, tokenizer and the like (the operator's models folder, not the
    job's: read as ordinary files)."""
    folder = Path(job.model_path)
    if not folder.is_dir():
        raise NothingToPush(f"a full fine-tune is pushed with its base model's config and tokenizer, "
                            f"and {job.model_path!r} is no folder on this server")
    files: Files = {}
    for path in sorted(folder.iterdir()):
        name = path.name
        if (name.startswith(".") or name in BASE_SKIPPED_NAMES or name.endswith(BASE_SKIPPED_SUFFIXES)
                or not path.is_file() or path.stat().st_size > MAX_BASE_FILE_BYTES):
            continue
        files[name] = path.read_bytes()
    if MODEL_CONFIG_FILE not in files:
        raise NothingToPush(f"the base model folder {job.model_path} has no {MODEL_CONFIG_FILE}")
    return files
