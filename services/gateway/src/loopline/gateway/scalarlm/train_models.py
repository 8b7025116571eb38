"""ScalarLM's training response shapes (what its server returns for train, get and list_models),
built from the trainer's JobInfo. These are HTTP wire types; JobInfo is what crosses NATS."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from loopline.common.contracts.hub_push import HubPush
from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.job_schemas import HistoryPoint, JobInfo
from loopline.common.contracts.train_params import canonical

# What a job that shipped ml/ code runs (JobInfo.code_origin), said in its job_config.
ML_CODE_NOTES = {
    "shipped": "this job runs the ml/ code it shipped (user code is on for this server)",
    "installed": "the shipped ml/ is Loopline's own loopline.ml, byte for byte: the installed code runs",
}

# ScalarLM's `ls -l` shows the loss as an exponential moving average of the history.
LOSS_EMA = 0.9


class JobStatusBody(BaseModel):
    """What ScalarLM keeps in a job's status.json."""

    status: str
    model_name: str  # the job hash: the name to generate with
    job_directory: str
    job_id: str | None  # the Slurm job id
    start_time: float
    history: list[HistoryPoint]
    # Not ScalarLM's (its client passes them through): where the page of ``history`` starts, of how many.
    history_offset: int = 0
    history_total: int = 0
    max_steps: int
    step: int
    accumulated_train_seconds: float
    error: str | None


class TrainResponse(BaseModel):
    job_status: JobStatusBody
    job_config: dict[str, Any]
    deployed: bool
    # Not ScalarLM's (its client passes the JSON through): why the newest checkpoint is not served,
    # in the replica's words, so a job no replica can load does not sit at deployed=false silently.
    deployment_error: str | None = None
    # Not ScalarLM's either: the job's push to the Hugging Face Hub (its push_to_hub), once COMPLETED.
    hub: HubPush | None = None


class ModelEntry(BaseModel):
    name: str
    deployed: bool
    deployment_error: str | None = None  # as in TrainResponse
    status: str
    start_time: float
    step: int
    max_steps: int
    train_time: float
    loss: float | None


class ModelList(BaseModel):
    models: list[ModelEntry]


def train_seconds(info: JobInfo) -> float:
    if info.history:
        return info.history[-1].time
    if info.started_at is None:
        return 0.0
    return max(0.0, (info.finished_at or time.time()) - info.started_at)


def smoothed_loss(history: list[HistoryPoint]) -> float | None:
    if not history:
        return None
    loss = history[0].loss
    for point in history[1:]:
        loss = LOSS_EMA * loss + (1 - LOSS_EMA) * point.loss
    return loss


def train_response(info: JobInfo, deployed: bool, deployment_error: str | None = None) -> TrainResponse:
    status = JobStatusBody(
        status=info.status.value, model_name=info.job_hash, job_directory=info.job_directory,
        job_id=info.slurm_job_id, start_time=info.created_at, history=info.history,
        history_offset=info.history_offset, history_total=info.history_total,
        max_steps=info.max_steps, step=info.step, accumulated_train_seconds=train_seconds(info),
        error=info.error,
    )
    # The params as the user set them (canonical), then the effective values, which win (llm_name
    # filled in, adapter_type defaulted).
    config = {**canonical(info.params), "llm_name": info.llm_name, "adapter_type": info.adapter_type,
              "dataset_hash": info.dataset_sha256, "job_directory": info.job_directory,
              "training_data_path": f"{info.job_directory}/{DATASET_FILE}"}
    if info.code_origin is not None:  # keys ScalarLM's client does not read: only added
        config.update(ml_code=info.code_origin, ml_code_note=ML_CODE_NOTES[info.code_origin])
    return TrainResponse(job_status=status, job_config=config, deployed=deployed,
                         deployment_error=deployment_error, hub=info.hub)


def model_entry(info: JobInfo, deployed: bool, deployment_error: str | None = None) -> ModelEntry:
    return ModelEntry(name=info.job_hash, deployed=deployed, deployment_error=deployment_error,
                      status=info.status.value, start_time=info.created_at, step=info.step,
                      max_steps=info.max_steps, train_time=train_seconds(info),
                      loss=smoothed_loss(info.history))
