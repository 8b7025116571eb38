"""ScalarLM-compatible training routes (/v1/megatron/*, as ScalarLM's server answers them and its
``scalarlm`` client uses them).

Jobs live in the trainer; these routes translate. Where ScalarLM answers 500 (unknown job) or
200+null (failed cancel), we pass on the trainer's honest status instead.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from starlette.datastructures import UploadFile

from loopline.common.contracts import subjects
from loopline.gateway.auth.scopes import ADMIN, TRAINING
from loopline.gateway.auth.tenancy import tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.route_spec import TRAINER, declare
from loopline.gateway.gateway import gateway_of
from loopline.gateway.scalarlm.statuses import ARCHIVE, JOB, TRAIN_BODY
from loopline.gateway.scalarlm.train_models import ModelList, TrainResponse, model_entry
from loopline.gateway.scalarlm.train_submit import parse_params, respond, submit_archive, trainer_of

router = APIRouter(prefix="/v1/megatron")

# The params part is a small JSON object; the file part is spooled to a temporary file as it arrives.
MAX_PARAMS_BYTES = 1024 * 1024


@router.post("/train", response_model=TrainResponse, **declare(
    TRAINING, {**ARCHIVE, 400: f"no `file` part; {ARCHIVE[400]}", **TRAINER}, body=TRAIN_BODY))
async def train(request: Request):
    """multipart ``file`` (tar.gz with dataset.jsonlines and optional ml/) and ``params`` (JSON).
    The body's size cap is the upload limit (BodyLimit answers 413)."""
    form = await request.form(max_files=2, max_fields=4, max_part_size=MAX_PARAMS_BYTES)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "the multipart body needs a 'file' part with the training archive",
                           param="file")
        raw_params: UploadFile | str | bytes | None = form.get("params")
        if isinstance(raw_params, UploadFile):  # sent with a filename: read it, but only so much
            raw_params = await raw_params.read(MAX_PARAMS_BYTES)
        return await submit_archive(request, upload.file, parse_params(raw_params))
    finally:
        await form.close()


@router.get("/train/{job}", response_model=TrainResponse, **declare(TRAINING, {
    **JOB, 422: f"{JOB[422]}; or `history_limit` is above `LOOPLINE_MAX_HISTORY_POINTS`", **TRAINER}))
async def get_training_job(job: str, request: Request, history_offset: int | None = Query(None, ge=0),
                           history_limit: int | None = Query(None, ge=0)):
    """``job`` is a job hash, a unique prefix of one, or ``latest``: among the key's own jobs
    (auth/tenancy.py). ``job_status.history`` is one page of the loss history: its newest points
    (as many as the trainer's `LOOPLINE_MAX_HISTORY_POINTS`, all of a ScalarLM job's), or
    ``history_limit`` points from point ``history_offset``; ``history_total`` counts them all."""
    info = await trainer_of(request).get(job, tenant_of(request), history_offset=history_offset,
                                         history_limit=history_limit)
    return respond(request, info)


@router.get("/list_models", response_model=ModelList, **declare(TRAINING, TRAINER))
async def list_models(request: Request):
    """The key's own jobs (every job with admin, or with no keys)."""
    jobs = await trainer_of(request).list(tenant_of(request))
    adapters = gateway_of(request).adapters
    return ModelList(models=[model_entry(info, adapters.deployed(info.job_hash),
                                         adapters.deployment_error(info.job_hash)) for info in jobs.jobs])


async def own_job(request: Request, job: str) -> str:
    """The job's hash, when the request's API key may control it: a key without the admin scope
    only the jobs it submitted (auth/tenancy.py); another key's job is the same 404 as an unknown
    one. With no keys on, anyone any job."""
    tenant = tenant_of(request)
    if tenant is None:
        return job
    info = await trainer_of(request).get(job, tenant)
    return info.job_hash  # the job checked, even if 'latest' or the prefix now names another


# Its own jobs with a training key, any job with admin (``own_job``).
@router.post("/cancel/{job}", response_model=TrainResponse, **declare(
    TRAINING, {**JOB, 409: "the job is over already", **TRAINER}))
async def cancel(job: str, request: Request):
    job = await own_job(request, job)
    return respond(request, await trainer_of(request).control(subjects.SVC_TRAINER_CANCEL, job))


@router.post("/delete/{job}", response_model=TrainResponse, **declare(ADMIN, {**JOB, **TRAINER}))
async def delete(job: str, request: Request):
    return respond(request, await trainer_of(request).control(subjects.SVC_TRAINER_DELETE, job))


@router.post("/restart/{job}", response_model=TrainResponse, **declare(TRAINING, {
    **JOB, 409: "only a failed or cancelled job restarts, once its previous run has stopped", **TRAINER}))
async def restart(job: str, request: Request):
    """Only a FAILED or CANCELLED job restarts; the trainer answers 409 otherwise."""
    job = await own_job(request, job)
    return respond(request, await trainer_of(request).control(subjects.SVC_TRAINER_RESTART, job))


@router.get("/squeue", **declare(TRAINING, TRAINER))
async def squeue(request: Request):
    """Slurm's queue; a tenant's key sees only its own jobs' rows (auth/tenancy.py)."""
    return (await trainer_of(request).squeue(tenant_of(request))).model_dump()


@router.get("/gpu_count", **declare(TRAINING, TRAINER))
async def gpu_count(request: Request):
    return {"gpu_count": (await trainer_of(request).cluster()).gpu_count}


@router.get("/node_count", **declare(TRAINING, TRAINER))
async def node_count(request: Request):
    return {"node_count": (await trainer_of(request).cluster()).node_count}
