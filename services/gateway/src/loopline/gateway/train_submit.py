"""From an uploaded training archive to a submitted job; shared by /v1/megatron/train and the chunked
upload's finalize, so both behave the same.

The order matters: hash first (from the uncompressed content, so re-packing the same data finds the
same job), ask whether the trainer knows the job (then nothing is stored or submitted again), store
the dataset under its content hash, and only then submit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import IO, Any

from fastapi import Request

from loopline.common import jobs
from loopline.common.job_schemas import JobInfo, JobSubmit
from loopline.common.settings import GatewaySettings
from loopline.gateway.errors import ApiError
from loopline.gateway.gateway import gateway_of
from loopline.gateway.train_models import TrainResponse, train_response
from loopline.gateway.trainer_client import TrainerClient

log = logging.getLogger(__name__)

_STATUS_OF = {jobs.BadArchive: 400, jobs.UnsafeArchive: 400, jobs.ArchiveTooLarge: 413,
              jobs.InvalidDataset: 422}


def trainer_of(request: Request) -> TrainerClient:
    return gateway_of(request).trainer


def respond(request: Request, info: JobInfo) -> TrainResponse:
    # Deployed once an inference replica serves the job hash as a model (MODELS bucket).
    # Deployed: some inference replica has loaded a checkpoint of the job (gateway/adapters.py).
    return train_response(info, deployed=gateway_of(request).adapters.deployed(info.job_hash))


def parse_params(raw: str | bytes | dict | None) -> dict[str, Any]:
    if raw is None or raw == "" or raw == b"":
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        params = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"params is not valid JSON: {exc}", param="params") from exc
    if not isinstance(params, dict):
        raise ApiError(422, f"params must be a JSON object of train_args, not {type(params).__name__}",
                       param="params")
    return params


def read_archive(source: Path | IO[bytes], settings: GatewaySettings) -> jobs.TrainingArchive:
    try:
        return jobs.read_training_archive(source, settings.max_dataset_bytes, settings.max_archive_members)
    except jobs.ArchiveError as exc:
        raise ApiError(_STATUS_OF.get(type(exc), 400), str(exc), param="file") from exc


async def submit_archive(request: Request, source: Path | IO[bytes], params: dict[str, Any]) -> TrainResponse:
    settings: GatewaySettings = request.app.state.settings
    trainer = trainer_of(request)
    # ScalarLM fills llm_name with the served model; it is part of the job, so before hashing.
    if not params.get("llm_name"):
        params = {**params, "llm_name": settings.model}
    archive = await asyncio.to_thread(read_archive, source, settings)
    with archive:
        try:
            job_hash = jobs.job_hash(params, archive.dataset_sha256, archive.code_sha256)
        except ValueError as exc:  # NaN or infinity in params: not JSON, cannot be hashed stably
            raise ApiError(422, f"params cannot be hashed: {exc}", param="params") from exc
        known = await trainer.find(job_hash)
        if known is not None:
            return respond(request, known)
        stored = await trainer.store_dataset(archive.dataset_sha256, archive.dataset)
        if archive.code is not None:
            await trainer.store_dataset(archive.code_sha256, archive.code)
        log.info("job %s: %d examples, dataset %s (%s)", job_hash, archive.examples,
                 archive.dataset_sha256[:12], "stored" if stored else "already stored")
        info = await trainer.submit(JobSubmit(
            job_hash=job_hash, params=params, dataset_sha256=archive.dataset_sha256,
            dataset_bytes=archive.dataset_bytes, examples=archive.examples,
            code_sha256=archive.code_sha256,
        ))
    return respond(request, info)
