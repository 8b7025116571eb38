"""Names of the Tinker API's things, and where they lie on disk: one spelling for every service.

    ids           session: 32 hex digits; model: ``<session>:train:<model_seq_id>`` (the SDK
                  rebuilds this string itself when it creates a client from state); worker: 32 hex
    request ids   ``tk`` + 40 hex digits, derived from (model, seq_id, kind): an SDK retry of the
                  same call gets the same id, and JetStream's dedupe drops its second publish
    tinker paths  ``tinker://<model id>/{weights|sampler_weights}/<name>`` (exactly three parts)

    <jobs_dir>/.tinker/workers/<worker>/        the worker's folder (0700)           (trainer)
    <jobs_dir>/.tinker/workers/.control/<worker>/  entrypoint.sh, secret.env, its log (trainer)
    <jobs_dir>/.tinker/runs/<model key>/weights/<name>/   save_state: adapter files,
                  optimizer.pt, lora.json                                      (session worker)
    <jobs_dir>/<sampler hash>/config.json + checkpoints/step-%08d/             (session worker)
                  a sampler checkpoint is laid out as a training job's, so the checkpoint-watcher
                  announces it and the inference replicas load it as they load any job's adapter

Each ``save_weights_for_sampler`` is its own adapter hash, not a new step of one: a sampling client
made from an earlier save keeps sampling exactly those weights while training goes on.

Standard library only: the session worker imports it inside a Slurm job.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

TINKER_DIR = ".tinker"  # starts with ".": the checkpoint-watcher never takes it for a job
WORKERS_DIR = "workers"
RUNS_DIR = "runs"
STATE_KINDS = ("weights", "sampler_weights")
OPTIMIZER_FILE = "optimizer.pt"
LORA_FILE = "lora.json"
SCHEME = "tinker://"

_MODEL_ID = re.compile(r"^([0-9a-f]{32}):train:(\d{1,9})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_id() -> str:
    """A session, worker or sampling-session id."""
    return uuid.uuid4().hex


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def is_model_id(text: object) -> bool:
    return isinstance(text, str) and _MODEL_ID.match(text) is not None


def model_key(model_id: str) -> str:
    """A model id as a KV key, subject token and folder name (it holds ':', which none allows)."""
    return hashlib.sha256(model_id.encode()).hexdigest()[:32]


def request_id(model_id: str, seq_id: int | None, kind: str) -> str:
    return "tk" + hashlib.sha256(f"{model_id}|{seq_id}|{kind}".encode()).hexdigest()[:40]


def is_training_request_id(text: str) -> bool:
    return len(text) == 42 and text.startswith("tk") and all(c in "0123456789abcdef" for c in text[2:])


def sampler_hash(model_id: str, name: str) -> str:
    """The adapter ("job") hash of one sampler save: a folder, a subject token, a served model."""
    return hashlib.sha256(f"{model_id}/sampler_weights/{name}".encode()).hexdigest()


def ephemeral_name(seq_id: int | None, request: str) -> str:
    """The name of an unnamed (``kind=snapshot``) sampler save; unique per call."""
    return f"ephemeral-{seq_id if seq_id is not None else 0}-{request[2:14]}"


def state_name(seq_id: int | None, request: str) -> str:
    """The name of an unnamed ``save_state``; unique per call."""
    return f"state-{seq_id if seq_id is not None else 0}-{request[2:14]}"


def is_name(text: object) -> bool:
    """A checkpoint name the user chose: one path segment, no separators or dot-files."""
    return isinstance(text, str) and _NAME.match(text) is not None and ".." not in text


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # "weights" (save_state) or "sampler_weights"
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"


def parse_path(text: str) -> TinkerPath:
    """``tinker://<model id>/<kind>/<name>``; ValueError says what is wrong with it."""
    if not text.startswith(SCHEME):
        raise ValueError(f"{text!r} is not a tinker path: it must start with {SCHEME}")
    parts = text[len(SCHEME):].split("/")
    if len(parts) != 3:
        raise ValueError(f"{text!r}: a tinker path is tinker://<model id>/<weights|sampler_weights>/<name>")
    model, kind, name = parts
    if not is_model_id(model):
        raise ValueError(f"{text!r}: {model!r} is not a model id of this server")
    if kind not in STATE_KINDS:
        raise ValueError(f"{text!r}: the kind must be one of {', '.join(STATE_KINDS)}, not {kind!r}")
    if not is_name(name):
        raise ValueError(f"{text!r}: {name!r} is not a checkpoint name (letters, digits, . _ -)")
    return TinkerPath(model, kind, name)


def worker_dir(jobs_dir: Path, worker_id: str) -> Path:
    return jobs_dir / TINKER_DIR / WORKERS_DIR / worker_id


def state_dir(jobs_dir: Path, model_id: str, name: str) -> Path:
    """Where ``save_state`` (``kind=weights``) keeps a model's adapter and optimizer."""
    return jobs_dir / TINKER_DIR / RUNS_DIR / model_key(model_id) / "weights" / name
