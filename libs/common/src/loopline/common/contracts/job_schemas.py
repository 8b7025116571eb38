"""Wire schemas of training jobs: gateway <-> trainer requests, and the job events users follow.

A job is named by its hash (``job_hash.py``): the canonical params plus the sha256 of the
uncompressed dataset (and of the job's own ``ml/`` code when it ships one). The trainer keeps the
registry; these types are only what crosses NATS. The params are ``train_params.TrainParams``,
carried in their canonical form (what the client set), so each side applies the same defaults.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field

from loopline.common.contracts.adapter_format import AdapterType
from loopline.common.contracts.hub_push import HubPush
from loopline.common.contracts.job_hash import JobHash, Sha256Hex
from loopline.common.contracts.train_params import CanonicalTrainParams


class JobStatus(str, Enum):
    QUEUED = "QUEUED"
    TRAINING = "TRAINING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


class JobSubmit(BaseModel):
    """Gateway -> trainer: the dataset (and code) are already in the ``datasets`` object store."""

    job_hash: JobHash
    # The user's train_args, validated, with ``llm_name`` filled in with the served model when absent.
    params: CanonicalTrainParams
    dataset_sha256: Sha256Hex  # object name in the datasets bucket; dataset.jsonlines, uncompressed
    dataset_bytes: int
    examples: int
    code_sha256: Sha256Hex | None = None  # object name of a deterministic tar of the job's own ml/
    # The name of the API key that submitted it (gateway/auth/api_keys.py); None when keys are off. A key
    # without the admin scope sees and controls only its own jobs (gateway/auth/tenancy.py).
    owner: str | None = Field(default=None, max_length=64)
    # The key holds the admin scope, or the gateway has no keys: its push_to_hub may go to any Hub
    # namespace, not only those the trainer's LOOPLINE_HUB_ALLOWED_NAMESPACES lists.
    admin: bool = False


# The ``owner`` of a request below: the trainer answers only among the jobs of that API key, as if
# the others did not exist (a hash, prefix or ``latest`` resolves among them alone, another's job is
# the same 404 as an unknown one). None: among every job (no keys, or an admin key).
OwnerFilter = str | None


class JobRef(BaseModel):
    """A job named by its hash, a unique prefix of it, or ``latest``."""

    job: str
    owner: OwnerFilter = None
    # A page of the job's loss history (a get's reply carries at most LOOPLINE_MAX_HISTORY_POINTS):
    # from point ``history_offset``, or its newest points when None.
    history_offset: int | None = Field(default=None, ge=0)
    history_limit: int | None = Field(default=None, ge=0)


class JobListRequest(BaseModel):
    owner: OwnerFilter = None


class HistoryPoint(BaseModel):
    step: int
    loss: float
    epoch: float = 0.0
    time: float = 0.0  # seconds of training so far


class CheckpointInfo(BaseModel):
    step: int
    path: str  # the checkpoint directory inside the job directory
    created_at: float


class JobInfo(BaseModel):
    job_hash: str
    status: JobStatus
    params: CanonicalTrainParams  # as submitted; llm_name and adapter_type below are the effective ones
    llm_name: str
    adapter_type: AdapterType
    job_directory: str
    # From the JobSubmit; the gateway shows them in ScalarLM's job_config (dataset_hash).
    dataset_sha256: str | None = None
    code_sha256: str | None = None
    # With a code_sha256: "shipped" (the job runs its own ml/, user code) or "installed" (its ml/
    # was byte for byte Loopline's own loopline.ml, which runs).
    code_origin: Literal["shipped", "installed"] | None = None
    slurm_job_id: str | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    step: int = 0
    max_steps: int = 0
    history: list[HistoryPoint] = Field(default_factory=list)
    # ``history`` is the page of the job's points from index history_offset, of history_total.
    history_offset: int = 0
    history_total: int = 0
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)  # the newest, as many as a page
    error: str | None = None
    owner: str | None = None  # JobSubmit.owner of its first submit
    # The push to the Hugging Face Hub its params asked for (push_to_hub), from COMPLETED on.
    hub: HubPush | None = None
    # Filled in by the gateway from the served models, not by the trainer.
    deployed: bool = False


class JobList(BaseModel):
    jobs: list[JobInfo]  # newest first


class JobEvent(BaseModel):
    """One message on ``events.jobs.<hash>.<kind>``; fields beyond kind depend on the kind."""

    job_hash: str
    kind: str  # one of subjects.JOB_EVENT_KINDS
    # Per job, increasing: the line number in the job's events.jsonl. Also the dedupe key,
    # Nats-Msg-Id = f"{job_hash}.{created_ms}:{seq}" (created_ms tells a re-submitted job after a
    # delete from the first one, whose ids the stream's dedupe window may still hold).
    seq: int
    time: float = Field(default_factory=time.time)
    status: JobStatus | None = None
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    learning_rate: float | None = None
    tokens_per_s: float | None = None
    epoch: float | None = None
    checkpoint: CheckpointInfo | None = None
    error: str | None = None
    hub: HubPush | None = None  # the ``hub`` event: the push's outcome


class LogsRequest(BaseModel):
    job: str
    owner: OwnerFilter = None
    starting_line_number: int = 0
    limit: int = 1000


class LogLine(BaseModel):
    line: str
    line_number: int


class LogLines(BaseModel):
    job_hash: str
    lines: list[LogLine]
    finished: bool  # the job is over: no more lines will come
    # The page ended at its limit or at LOOPLINE_MAX_LOG_PAGE_BYTES: more lines are there already.
    more: bool = False


class SqueueReply(BaseModel):
    squeue_output: str
    error_message: str | None = None


class ClusterInfo(BaseModel):
    gpu_count: int
    node_count: int
    launcher: str  # "slurm" or "local"


class CheckpointAnnounce(BaseModel):
    """One message on ``checkpoints.<base>.<hash>`` (stream CHECKPOINTS, the last one per subject
    kept): a job's newest checkpoint, stored in the ``adapters`` object store. Published by the
    checkpoint-watcher with Nats-Msg-Id ``f"{job_hash}:{step}:{sha256[:16]}:{created_ms}"``.

    The object is an uncompressed tar of ``adapter_config.json`` and ``adapter_model.safetensors``
    (docs/adapter-format.md), members sorted and timestamps zeroed, so the same checkpoint always
    gives the same bytes and hash.
    """

    job_hash: str
    step: int
    sha256: str  # hex digest of the stored object
    size: int  # bytes of the stored object
    created_at: float  # when the checkpoint was written (its folder's mtime), Unix seconds
    announced_at: float  # when the watcher published this (created_at -> announced_at: its latency)
    # "tokenformer" or "lora"; "none" is a full-weights checkpoint (stored, marked: inference decides).
    adapter_type: AdapterType
    base_model: str  # the served model the job adapts (its params' llm_name); <base> in the subject
    object_name: str  # in the adapters bucket: f"{job_hash}/{step}"
    adapter_config: dict[str, Any]  # adapter_config.json as the checkpoint holds it


class AdapterEvent(BaseModel):
    """One message on ``events.adapters.<hash>.<kind>`` (kinds: subjects.ADAPTER_EVENT_KINDS).

    ``rejected``: the checkpoint-watcher found the checkpoint corrupt (truncated or malformed
    safetensors, bad config, too large); it is never announced or served. An inference replica
    sends it too (``replica`` set) for an announced checkpoint its engine cannot serve (a full
    fine-tune on vLLM, a Tokenformer without the plugin). ``loaded``: a replica serves this step.
    ``retired``: the job was deleted (adapter_retire.py); every checkpoint of it written before
    ``time`` is withdrawn: replicas unload it once unpinned, gateways stop listing and routing it.
    """

    job_hash: str
    kind: str
    step: int | None = None
    time: float = Field(default_factory=time.time)
    reason: str | None = None  # why it was rejected
    path: str | None = None  # the checkpoint folder
    # Set by the inference replica that loaded (or could not load) the checkpoint. ``latency_s``:
    # checkpoint written (the announce's created_at) -> servable on that replica; ``load_s``: the
    # replica's own part (download, unpack, load into the engine).
    replica: str | None = None
    base_model: str | None = None
    adapter_type: str | None = None
    latency_s: float | None = None
    load_s: float | None = None
    # ``loaded``: when the checkpoint was written (its announce's created_at). A load of a checkpoint
    # written before the job's retirement is of the deleted job, however late it is heard.
    checkpoint_created_at: float | None = None
