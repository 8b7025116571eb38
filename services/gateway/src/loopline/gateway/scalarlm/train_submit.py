"""From an uploaded training archive to a submitted job; shared by /v1/megatron/train and the chunked
upload's finalize, so both behave the same.

The order matters: params validated first (a bad one is a 422 naming the field, before the archive is
read or anything stored), hash next (from the canonical params and the uncompressed content, so re-packing the
same data finds the same job), ask whether the trainer knows the job (then nothing is stored or
submitted again), store the dataset under its content hash, and only then submit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import IO, Any

from fastapi import Request
from pydantic import ValidationError

from loopline.common.config.settings import GatewaySettings
from loopline.common.contracts import training_archive as archives
from loopline.common.contracts.job_hash import job_hash as hash_job
from loopline.common.contracts.job_schemas import JobInfo, JobSubmit
from loopline.common.contracts.train_params import TrainParams, canonical
from loopline.gateway.auth.tenancy import owner_of, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import over_limit
from loopline.gateway.core.trainer_client import TrainerClient
from loopline.gateway.gateway import gateway_of
from loopline.gateway.scalarlm.train_models import TrainResponse, train_response
from loopline.gateway.scalarlm.train_servable import check_servable

log = logging.getLogger(__name__)

_STATUS_OF = {archives.BadArchive: 400, archives.UnsafeArchive: 400, archives.ArchiveTooLarge: 413,
              archives.InvalidDataset: 422}


def trainer_of(request: Request) -> TrainerClient:
    return gateway_of(request).trainer


def respond(request: Request, info: JobInfo) -> TrainResponse:
    # Deployed: some inference replica has loaded a checkpoint of the job (gateway/core/adapters.py).
    adapters = gateway_of(request).adapters
    return train_response(info, deployed=adapters.deployed(info.job_hash),
                          deployment_error=adapters.deployment_error(info.job_hash))


def parse_params(raw: str | bytes | None) -> TrainParams:
    """The multipart ``params`` part (JSON train_args), validated."""
    if raw is None or raw == "" or raw == b"":
        return TrainParams()
    try:
        params = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"params is not valid JSON: {exc}", param="params") from exc
    if not isinstance(params, dict):
        raise ApiError(422, f"params must be a JSON object of train_args, not {type(params).__name__}",
                       param="params")
    return validate_params(params)


def validate_params(params: dict[str, Any]) -> TrainParams:
    """422 naming the first bad field (``params.lora_config.r``), as FastAPI words a bad body."""
    try:
        return TrainParams.model_validate(params)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(["params", *(str(part) for part in first["loc"])])
        raise ApiError(422, f"{where}: {first['msg']}", param=where) from exc


def read_archive(source: Path | IO[bytes], settings: GatewaySettings,
                 training_mode: archives.TrainingMode = "language_model") -> archives.TrainingArchive:
    try:
        return archives.read_training_archive(source, settings.max_dataset_bytes,
                                              settings.max_archive_members,
                                              settings.max_dataset_line_bytes, training_mode)
    except archives.LineTooLong as exc:
        raise over_limit(413, f"{archives.DATASET_FILE} line {exc.number} is too long", exc.limit,
                         "max_dataset_line_bytes", param="file") from exc
    except archives.ArchiveError as exc:
        raise ApiError(_STATUS_OF.get(type(exc), 400), str(exc), param="file") from exc


async def check_base_model(request: Request, llm_name: str) -> None:
    """A key without admin trains only a model this deployment serves (by its served name or the
    folder it is loaded from), unless LOOPLINE_ALLOW_ANY_BASE_MODEL: the trainer loads ``llm_name``
    as given, a path on the training machines or a Hub id to download."""
    settings: GatewaySettings = request.app.state.settings
    if tenant_of(request) is None or settings.allow_any_base_model or llm_name == settings.model:
        return
    models = gateway_of(request).models
    await models.refresh()
    names = {settings.model, *models.served}
    if llm_name not in names and llm_name not in {info.model_path for info in models.served.values()}:
        raise ApiError(400, f"params.llm_name {llm_name!r} is not a model this server serves "
                            f"({', '.join(sorted(names))}): training another base model needs an admin "
                            "key, or LOOPLINE_ALLOW_ANY_BASE_MODEL=true", param="params.llm_name")


async def submit_archive(request: Request, source: Path | IO[bytes], params: TrainParams) -> TrainResponse:
    settings: GatewaySettings = request.app.state.settings
    trainer = trainer_of(request)
    owner = owner_of(request)
    # ScalarLM fills llm_name with the served model; it is part of the job, so before hashing.
    if not params.llm_name:
        params = params.model_copy(update={"llm_name": settings.model})
    await check_base_model(request, params.llm_name or settings.model)
    check_servable(await gateway_of(request).models.deployment_of(params.llm_name or settings.model), params)
    archive = await asyncio.to_thread(read_archive, source, settings, params.training_mode)
    with archive:
        try:
            # Over the canonical params (what the client set, validated: see train_params.canonical),
            # so {"seed": null} and {}, or "LoRA" and "lora", are one job.
            job_hash = hash_job(canonical(params), archive.dataset_sha256, archive.code_sha256, owner)
        except ValueError as exc:  # NaN or infinity in an unknown key: not JSON, cannot be hashed
            raise ApiError(422, f"params cannot be hashed: {exc}", param="params") from exc
        known = await trainer.find(job_hash)
        if known is not None:
            return respond(request, known)
        stored = await trainer.store_dataset(archive.dataset_sha256, archive.dataset)
        if archive.code is not None:
            assert archive.code_sha256 is not None  # read_training_archive sets both
            await trainer.store_dataset(archive.code_sha256, archive.code)
        log.info("job %s: %d examples, dataset %s (%s)", job_hash, archive.examples,
                 archive.dataset_sha256[:12], "stored" if stored else "already stored")
        info = await trainer.submit(JobSubmit(
            job_hash=job_hash, params=params, dataset_sha256=archive.dataset_sha256,
            dataset_bytes=archive.dataset_bytes, examples=archive.examples,
            code_sha256=archive.code_sha256, owner=owner, admin=tenant_of(request) is None,
        ))
    return respond(request, info)
