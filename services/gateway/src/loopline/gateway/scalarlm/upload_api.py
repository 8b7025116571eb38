"""ScalarLM's chunked training upload: init, chunk (retried by the client on 422), finalize.

Its client switches to this path above 90 MiB (proxies such as Cloudflare cap a body at 100 MB).
Finalize hands the assembled archive to the same submit path as /v1/megatron/train. The chunks are
kept in NATS (upload_chunks.py), so init, chunks and finalize may each go to another gateway.
"""

from __future__ import annotations

import hashlib

from fastapi import APIRouter, Request
from nats.js.errors import NotFoundError
from pydantic import BaseModel, Field, field_validator

from loopline.common.contracts.job_hash import Sha256Hex
from loopline.common.contracts.train_params import TrainParams, canonical
from loopline.gateway.auth.scopes import TRAINING
from loopline.gateway.auth.tenancy import owner_of, sees, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import over_limit
from loopline.gateway.core.route_spec import FIELDS, NOT_JSON, TRAINER, declare
from loopline.gateway.gateway import gateway_of
from loopline.gateway.scalarlm.statuses import ARCHIVE, CHUNK_BODY
from loopline.gateway.scalarlm.train_models import TrainResponse
from loopline.gateway.scalarlm.train_submit import submit_archive, validate_params
from loopline.gateway.scalarlm.upload_chunks import ChunkStaging, UnknownUpload, UploadPlan

router = APIRouter(prefix="/v1/megatron/upload")


class InitRequest(BaseModel):
    total_size: int = Field(gt=0)
    total_hash: Sha256Hex
    chunk_size: int = Field(gt=0)
    num_chunks: int = Field(gt=0)
    compressed: bool = True  # informative only: the packing is recognised from the bytes
    # Validated here, so a bad one is refused (422 naming the field) before any chunk is sent.
    params: TrainParams = Field(default_factory=TrainParams)

    @field_validator("total_hash", mode="before")
    @classmethod
    def _lower_case(cls, value):
        return value.lower() if isinstance(value, str) else value  # hex digits of either case


class FinalizeRequest(BaseModel):
    upload_id: str


def staging_of(request: Request) -> ChunkStaging:
    return request.app.state.upload_staging


async def plan_of(request: Request, upload_id: str) -> UploadPlan:
    """The upload's plan; another key's upload is an unknown one (auth/tenancy.py)."""
    try:
        plan = await staging_of(request).plan(gateway_of(request).js, upload_id)
        if not sees(tenant_of(request), plan.owner):
            raise UnknownUpload(upload_id)
        return plan
    except UnknownUpload as exc:
        raise ApiError(404, f"no upload {upload_id!r}: unknown, finished or expired; start again with "
                            "/v1/megatron/upload/init", param="upload_id") from exc


@router.post("/init", **declare(TRAINING, {
    400: NOT_JSON, 413: "the upload or its chunks are larger than the limits, or it has more chunks "
                        "than `LOOPLINE_MAX_UPLOAD_CHUNKS`",
    422: f"{FIELDS}; the chunk count does not match the sizes; invalid `params`"}))
async def init(body: InitRequest, request: Request):
    settings = request.app.state.settings
    if body.total_size > settings.max_upload_bytes:
        raise ApiError(413, f"the upload is {body.total_size} bytes; the limit is "
                            f"{settings.max_upload_bytes}")
    if body.chunk_size > settings.max_chunk_bytes:
        raise ApiError(413, f"chunks of {body.chunk_size} bytes are larger than the limit of "
                            f"{settings.max_chunk_bytes}; send smaller chunks")
    # Before the plan is stored: init and finalize look up every chunk (one coroutine each).
    if body.num_chunks > settings.max_upload_chunks:
        raise over_limit(413, f"{body.num_chunks} chunks in one upload", settings.max_upload_chunks,
                         "max_upload_chunks", param="num_chunks")
    needed = -(-body.total_size // body.chunk_size)
    if needed > settings.max_upload_chunks:
        raise over_limit(413, f"{body.total_size} bytes in chunks of {body.chunk_size} make {needed} chunks",
                         settings.max_upload_chunks, "max_upload_chunks", param="chunk_size")
    if body.num_chunks != -(-body.total_size // body.chunk_size):
        raise ApiError(422, f"{body.total_size} bytes in chunks of {body.chunk_size} make "
                            f"{-(-body.total_size // body.chunk_size)} chunks, not {body.num_chunks}")
    plan = UploadPlan(body.total_size, body.total_hash, body.chunk_size, body.num_chunks,
                      canonical(body.params), owner=owner_of(request))
    upload_id, received = await staging_of(request).open(gateway_of(request).js, plan)
    return {"upload_id": upload_id, "received_chunks": received}


def _header(request: Request, name: str) -> str:
    value = request.headers.get(name)
    if not value:
        raise ApiError(400, f"the {name} header is missing", param=name)
    return value.strip()


@router.post("/chunk", **declare(TRAINING, {
    400: "a header is missing, or the chunk index or length does not fit the upload",
    404: "no such upload: unknown, finished or expired", 413: "the chunk is larger than the limit",
    422: "the chunk's sha256 is not its `X-Chunk-Hash`: send it again"}, body=CHUNK_BODY))
async def chunk(request: Request):
    """The raw chunk as the body; headers X-Upload-Id, X-Chunk-Index, X-Chunk-Hash (sha256 hex)."""
    settings = request.app.state.settings
    staging = staging_of(request)
    upload_id = _header(request, "X-Upload-Id")
    index_text, expected = _header(request, "X-Chunk-Index"), _header(request, "X-Chunk-Hash").lower()
    plan = await plan_of(request, upload_id)
    if not (index_text.isascii() and index_text.isdigit()) or int(index_text) >= plan.num_chunks:
        raise ApiError(400, f"X-Chunk-Index {index_text!r} is not a chunk of this upload "
                            f"(0..{plan.num_chunks - 1})", param="X-Chunk-Index")
    index = int(index_text)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_chunk_bytes:
        raise ApiError(413, f"chunk {index} is {declared} bytes; the limit is {settings.max_chunk_bytes}")
    sha, size = hashlib.sha256(), 0
    with staging.new_part() as part:
        # Each piece is written as it arrives: a local write to the page cache, shorter than a thread hop.
        async for piece in request.stream():
            size += len(piece)
            if size > settings.max_chunk_bytes:
                raise ApiError(413, f"chunk {index} is larger than the limit of "
                                    f"{settings.max_chunk_bytes} bytes")
            sha.update(piece)
            part.write(piece)
        if sha.hexdigest() != expected:
            # 422 tells ScalarLM's client the chunk was damaged on the way: it sends it again.
            raise ApiError(422, f"chunk {index} has sha256 {sha.hexdigest()}, not the {expected} in "
                                "X-Chunk-Hash; send it again")
        if size != plan.chunk_length(index):
            raise ApiError(400, f"chunk {index} is {size} bytes; this upload's chunk {index} is "
                                f"{plan.chunk_length(index)} bytes")
        await staging.accept(gateway_of(request).js, upload_id, plan, index, part)
    return {"upload_id": upload_id, "chunk_index": index, "received": True, "bytes_written": size}


@router.post("/finalize", response_model=TrainResponse, **declare(TRAINING, {
    **ARCHIVE, 400: f"{NOT_JSON}; {ARCHIVE[400]}", 404: "no such upload: unknown, finished or expired",
    409: "chunks are missing: send them, then finalize again",
    422: f"{FIELDS}; the assembled upload is not what init declared; {ARCHIVE[422]}", **TRAINER}))
async def finalize(body: FinalizeRequest, request: Request):
    staging, js = staging_of(request), gateway_of(request).js
    plan = await plan_of(request, body.upload_id)
    missing = sorted(set(range(plan.num_chunks)) - set(await staging.received(js, body.upload_id, plan)))
    if missing:
        raise ApiError(409, _missing(missing, plan), param="upload_id")
    try:
        archive, sha, size = await staging.assemble(js, body.upload_id, plan)
    except NotFoundError as exc:  # a chunk ran out of time between the check and the read
        raise ApiError(409, _missing([], plan), param="upload_id") from exc
    with archive:
        if (sha, size) != (plan.total_hash, plan.total_size):
            await staging.discard(js, body.upload_id)
            raise ApiError(422, f"the assembled upload is {size} bytes with sha256 {sha}; init declared "
                                f"{plan.total_size} bytes with {plan.total_hash}; upload it again")
        try:
            response = await submit_archive(request, archive, validate_params(dict(plan.params)))
        except ApiError as exc:
            if exc.status < 500:  # the archive itself is refused: keeping it helps nobody
                await staging.discard(js, body.upload_id)
            raise
    await staging.discard(js, body.upload_id)
    return response


def _missing(missing: list[int], plan: UploadPlan) -> str:
    which = f"chunks {missing[:20]}" if missing else "some chunks"
    return (f"{which} of {plan.num_chunks} have not arrived (or expired); send them, then finalize "
            "again")
