"""The Tinker API's sessions, training calls and futures (``/api/v1/*``), for the unmodified
``tinker`` SDK 0.38 (its wire contract: docs/tinker.md and the SDK's own types, which parse the
bodies here).

A training call is answered at once with a future (``{"request_id", "model_id"}``); the call goes
to its model's session worker through TINKER_CALLS (part.py) and the worker stores the
result in TINKER_FUTURES, where ``retrieve_future`` finds it. A request id is derived from
(model, seq_id, kind), so an SDK retry of a call is the same call.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
from tinker import types as tt

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.contracts.tinker_schemas import (
    CallKind,
    LoraSpec,
    PlaceModel,
    StepCall,
    TinkerModel,
    TinkerSession,
)
from loopline.gateway.auth.api_keys import api_key_of
from loopline.gateway.auth.scopes import ANY_KEY, TRAINING, allows
from loopline.gateway.auth.tenancy import owner_of, sees, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import over_limit
from loopline.gateway.core.route_spec import TRAINER, declare
from loopline.gateway.gateway import gateway_of
from loopline.gateway.tinker import proto
from loopline.gateway.tinker.bodies import json_object, parse
from loopline.gateway.tinker.sampling_api import wait_sample
from loopline.gateway.tinker.statuses import BODY, CALL, MODEL, MODELS_QUOTA, QUOTA, SESSION

router = APIRouter(prefix="/api/v1")

PROTO = "application/x-protobuf"


# --- bootstrap and sessions ----------------------------------------------------------------------
# Sessions are everyone's (a sampling client and a training client both keep one), training is
# training's.
@router.post("/client/config", **declare(ANY_KEY))
async def client_config() -> dict[str, Any]:
    # Every field of the SDK's ClientConfigResponse keeps its default: JWT exchange off, protobuf
    # forward_backward bodies not compressed, the optional routes (retrieve_futures, server-side
    # custom losses, join_sampling_session) off.
    return {}


@router.post("/create_session", **declare(ANY_KEY, {400: BODY, 429: QUOTA}))
async def create_session(request: Request) -> dict[str, Any]:
    body = await parse(request, tt.CreateSessionRequest)
    gateway_of(request).session_quota.take(request)
    session = TinkerSession(session_id=tinker_names.new_id(), tags=body.tags, owner=owner_of(request),
                            user_metadata={k: str(v) for k, v in (body.user_metadata or {}).items()})
    await gateway_of(request).tinker.store.put_session(session)
    return {"session_id": session.session_id, "type": "create_session"}


async def _session(request: Request, session_id: str) -> TinkerSession:
    session = await gateway_of(request).tinker.session(session_id, tenant_of(request))
    if session is None:  # or another key's (auth/tenancy.py)
        # 410: the SDK stops heartbeating a session the server no longer has.
        raise ApiError(410, f"no session {session_id!r} on this server", param="session_id")
    return session


@router.post("/session_heartbeat", **declare(ANY_KEY, {400: BODY, **SESSION}))
async def session_heartbeat(request: Request) -> dict[str, Any]:
    raw = await json_object(request)
    session = await _session(request, str(raw.get("session_id", "")))
    session.heartbeat_at = time.time()
    await gateway_of(request).tinker.store.put_session(session)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish", **declare(ANY_KEY, {400: BODY, **SESSION}))
async def finish_session(request: Request, session_id: str) -> dict[str, Any]:
    raw = await json_object(request)
    session = await _session(request, session_id)
    reason = raw.get("reason")
    session.finished = str(reason.get("type", "finished")) if isinstance(reason, dict) else "finished"
    await gateway_of(request).tinker.store.put_session(session)
    return {}


@router.post("/telemetry", **declare(ANY_KEY))
async def telemetry() -> dict[str, Any]:
    return {"status": "accepted"}


# --- creating a training client ------------------------------------------------------------------
@router.post("/create_model", **declare(TRAINING, {
    400: f"{BODY}; no lora_config; an optimizer other than AdamW; a rank above the largest served; "
         "train_unembed on a model whose vLLM class serves no LoRA on lm_head; train_mlp on a "
         "mixture of experts served on CPU",
    404: "the base model is not served here", 429: MODELS_QUOTA, **SESSION, **TRAINER}))
async def create_model(request: Request) -> dict[str, Any]:
    body = await parse(request, tt.CreateModelRequest)
    tinker = gateway_of(request).tinker
    await _session(request, body.session_id)
    if body.lora_config is None:
        raise ApiError(400, "lora_config is required: this server trains LoRA adapters", param="lora_config")
    if body.optimizer_config.type != "adamw":
        raise ApiError(400, f"optimizer {body.optimizer_config.type!r} is not supported here; use AdamW",
                       param="optimizer_config")
    info = await tinker.base(body.base_model)
    _check_rank(info.max_adapter_rank, body.lora_config.rank, info.model)
    _check_unembed(info, body.lora_config.train_unembed)
    _check_mlp(info, body.lora_config.train_mlp)
    model_id = tinker_names.model_id(body.session_id, body.model_seq_id)
    await _check_live_models(request, model_id)
    model = TinkerModel(model_id=model_id, session_id=body.session_id, base_model=info.model,
                        model_path=info.model_path or info.model, model_name=body.base_model,
                        owner=owner_of(request),
                        lora=LoraSpec.model_validate(body.lora_config.model_dump()), worker_id="",
                        user_metadata={k: str(v) for k, v in (body.user_metadata or {}).items()})
    call = StepCall(request_id=tinker_names.request_id(model_id, None, "create_model"), model_id=model_id,
                    kind="create_model", body=body.model_dump_json())
    await _place(request, model, call)
    return {"request_id": call.request_id, "model_id": model_id}


def _check_rank(max_rank: int | None, rank: int, base: str) -> None:
    if max_rank is None:
        raise ApiError(400, f"the replicas serving {base!r} serve no adapters (LOOPLINE_ADAPTERS is off)",
                       param="base_model")
    if rank > max_rank:
        raise ApiError(400, f"rank {rank} is above the largest this server serves ({max_rank}; "
                            "LOOPLINE_MAX_ADAPTER_RANK)", param="lora_config.rank")


def _check_unembed(info: DeploymentInfo, train_unembed: bool) -> None:
    """A LoRA on lm_head trains, but vLLM serves it only for some model classes (the replica reads
    which from vLLM: inference/lora_targets.py); elsewhere every sample of it would fail, so the
    client is refused now rather than after it has trained."""
    if train_unembed and info.lora_lm_head is False:
        raise ApiError(400, f"train_unembed=True is not supported for {info.model!r}: vLLM serves its "
                            f"model class ({info.architecture}) with no LoRA on lm_head, so an adapter "
                            "that trains the unembedding could not be sampled; create the training client "
                            "with train_unembed=False", param="lora_config.train_unembed")


def _check_mlp(info: DeploymentInfo, train_mlp: bool) -> None:
    """A mixture of experts on CPU takes no LoRA on its MLP (the experts: contracts/model_support.py);
    its replicas say which layers they take one on, and an adapter on others is refused now."""
    if train_mlp and info.lora_modules is not None and "gate_proj" not in info.lora_modules:
        raise ApiError(400, f"train_mlp=True is not supported for {info.model!r}: its replicas serve a "
                            f"LoRA on {', '.join(info.lora_modules)} only ({info.architecture}: a mixture "
                            "of experts served on CPU, where vLLM runs no LoRA on the experts); create "
                            "the training client with train_mlp=False", param="lora_config.train_mlp")


async def _check_live_models(request: Request, model_id: str) -> None:
    """Before a new training client is placed: its key's live ones are under the limit (a retried
    create of one already placed is not a new one)."""
    gateway = gateway_of(request)
    limit = gateway.settings.max_tinker_models_per_key
    owner = owner_of(request)
    live = [m.model_id for m in await gateway.tinker.store.models()
            if m.state == "active" and m.owner == owner and m.model_id != model_id]
    if len(live) >= limit:
        holder = "the clients of this server (no API keys)" if owner is None else f"key {owner!r}"
        error = over_limit(429, f"{holder} holds {len(live)} live training clients; one is "
                                "released once idle for `LOOPLINE_TINKER_IDLE_TTL_S` (its state is kept "
                                "only if saved), then another can be created", limit,
                           "max_tinker_models_per_key")
        # The SDK retries a 429 for about a minute (measured: 57 s); a slot frees in an idle-out.
        error.headers["x-should-retry"] = "false"
        raise error


async def _place(request: Request, model: TinkerModel, first: StepCall) -> TinkerModel:
    gateway = gateway_of(request)
    return await gateway.trainer.call(subjects.SVC_TRAINER_TINKER_PLACE, PlaceModel(model=model, first=first),
                                      TinkerModel, timeout_s=60)


@router.post("/get_info", **declare(TRAINING, {400: BODY, 404: MODEL}))
async def get_info(request: Request) -> dict[str, Any]:
    raw = await json_object(request)
    model = await gateway_of(request).tinker.model(str(raw.get("model_id", "")), tenant_of(request))
    by_folder = request.app.state.settings.tinker_tokenizer_id == "folder"
    return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": model.lora.rank,
            "model_name": model.model_name,
            "model_data": {"model_name": model.model_name,
                           "tokenizer_id": model.model_path if by_folder else model.model_name}}


# --- training calls ------------------------------------------------------------------------------
@router.post("/forward_backward", **declare(TRAINING, {
    **CALL, 400: "not a ForwardBackwardRequest, or its zstd does not decode; its data would expand past "
                 "`LOOPLINE_TINKER_MAX_REQUEST_BYTES` dense",
    415: "the body is not protobuf (application/x-protobuf)"}))
async def forward_backward(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    if request.headers.get("content-type", "").split(";")[0].strip() != PROTO:
        raise ApiError(415, f"forward_backward takes a protobuf body ({PROTO}), as tinker>=0.25 sends")
    try:
        # zstd undone here, once; the routing fields read, and the data sized from its shapes (a
        # parse of at most max_body_bytes, nothing densified): the worker decodes the data.
        data = proto.request_body(await request.body(), request.headers.get("content-encoding"),
                                  gateway.settings.max_body_bytes)
        model_id, seq_id = proto.route_of(data)
        size = proto.dense_size(data)
    except ValueError as exc:
        raise ApiError(400, f"not a ForwardBackwardRequest: {exc}") from None
    # Before it is published: the worker would refuse it too, but only after the client waited.
    if size.bytes > gateway.settings.tinker_max_request_bytes:
        raise over_limit(400, f"the request's {size.datums} datums expand to {size.cells} cells "
                              f"({size.bytes} bytes) dense", gateway.settings.tinker_max_request_bytes,
                         "tinker_max_request_bytes")
    model = await gateway.tinker.model(model_id, tenant_of(request))
    call = StepCall(request_id=tinker_names.request_id(model.model_id, seq_id, "forward_backward"),
                    model_id=model.model_id, seq_id=seq_id, kind="forward_backward")
    await gateway.tinker.submit(model, call, data)
    return {"request_id": call.request_id, "model_id": model.model_id}


async def _json_call(request: Request, kind: CallKind, body_type: type[BaseModel]) -> dict[str, Any]:
    body = await parse(request, body_type)
    gateway = gateway_of(request)
    model = await gateway.tinker.model(str(getattr(body, "model_id", "")), tenant_of(request))
    seq_id = getattr(body, "seq_id", None)
    call = StepCall(request_id=tinker_names.request_id(model.model_id, seq_id, kind), model_id=model.model_id,
                    seq_id=seq_id, kind=kind, body=(await request.body()).decode())
    await gateway.tinker.submit(model, call)
    return {"request_id": call.request_id, "model_id": model.model_id}


@router.post("/optim_step", **declare(TRAINING, {**CALL, 400: f"{BODY}; optimizer_params (only AdamW)"}))
async def optim_step(request: Request) -> dict[str, Any]:
    if "optimizer_params" in await json_object(request):
        raise ApiError(400, "only AdamW is supported here (adam_params), not optimizer_params",
                       param="optimizer_params")
    return await _json_call(request, "optim_step", tt.OptimStepRequest)


@router.post("/save_weights_for_sampler", **declare(TRAINING, {
    **CALL, 400: f"{BODY}; a kind other than snapshot; a bad checkpoint name"}))
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    body = await parse(request, tt.SaveWeightsForSamplerRequest)
    if body.kind != "snapshot":
        raise ApiError(400, f"kind={body.kind!r} sampler saves are not supported here; use 'snapshot'",
                       param="kind")
    _check_name(body.path)
    return await _json_call(request, "save_weights_for_sampler", tt.SaveWeightsForSamplerRequest)


@router.post("/save_weights", **declare(TRAINING, {**CALL, 400: f"{BODY}; a bad checkpoint name"}))
async def save_weights(request: Request) -> dict[str, Any]:
    body = await parse(request, tt.SaveWeightsRequest)
    _check_name(body.path)
    return await _json_call(request, "save_weights", tt.SaveWeightsRequest)


def _check_name(name: str | None) -> None:
    if name is not None and not tinker_names.is_name(name):
        raise ApiError(400, f"{name!r} is not a checkpoint name: use letters, digits, '.', '_' and '-'",
                       param="path")


@router.post("/load_weights", **declare(TRAINING, {
    **CALL, 400: f"{BODY}; not a tinker path of this server", 404: f"{MODEL}, or no such checkpoint",
    429: f"{CALL[429]}; or, for a new training client, {MODELS_QUOTA}", **SESSION, **TRAINER}))
async def load_weights(request: Request) -> dict[str, Any]:
    body = await parse(request, tt.LoadWeightsRequest)
    tinker = gateway_of(request).tinker
    try:
        path = tinker_names.parse_path(body.path)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="path") from None
    source = await tinker.checkpoint(path.model_id, path.kind, path.name, tenant_of(request))
    if source is None:
        raise ApiError(404, f"no checkpoint {body.path}", param="path")
    if body.model_id is not None:
        return await _json_call(request, "load_weights", tt.LoadWeightsRequest)
    # A new training client made from saved state: the checkpoint's model tells what it adapts.
    if body.session_id is None or body.model_seq_id is None:
        raise ApiError(400, "load_weights needs model_id, or session_id and model_seq_id", param="model_id")
    await _session(request, body.session_id)
    origin = await tinker.model(path.model_id, tenant_of(request))
    model_id = tinker_names.model_id(body.session_id, body.model_seq_id)
    await _check_live_models(request, model_id)
    model = origin.model_copy(update={
        "model_id": model_id, "session_id": body.session_id, "worker_id": "", "state": "active",
        "owner": owner_of(request),
        "error": None, "created_at": time.time(), "last_request_at": time.time()})
    call = StepCall(request_id=tinker_names.request_id(model_id, None, "load_weights"), model_id=model_id,
                    kind="load_weights", body=body.model_dump_json())
    await _place(request, model, call)
    return {"request_id": call.request_id, "model_id": model_id}


# --- futures -------------------------------------------------------------------------------------
# A sample's future and a training step's alike.
@router.post("/retrieve_future", **declare(ANY_KEY, {
    400: BODY, 403: "a training call's future, asked with a key without the training scope",
    404: "no such future"}))
async def retrieve_future(request: Request) -> Response:
    body = await parse(request, tt.FutureRetrieveRequest)
    gateway = gateway_of(request)
    rid = body.request_id
    poll_s = gateway.settings.tinker_poll_s
    key = api_key_of(request)
    if tinker_names.is_training_request_id(rid) and key is not None and not allows(key.scopes, TRAINING):
        # A training call's id derives from its model id; a key that cannot train has none of its
        # own, so a training future is never its to read (a sample's future is the sampler's).
        raise ApiError(403, f"API key {key.name!r} lacks the 'training' scope a training call's future "
                            "needs", param="request_id", type="permission_error")
    if tinker_names.is_training_request_id(rid):
        result = await gateway.tinker.wait(rid, poll_s)
        if result is not None and not await _sees_run(request, result.model_id):
            # Another key's run: answered as a future nobody has made yet, after as long a wait.
            await asyncio.sleep(poll_s)
            result = None
    else:
        result = await wait_sample(gateway, rid, poll_s)
    if result is None:
        # The SDK polls again at once: the wait above is the long poll.
        return _json({"type": "try_again", "request_id": rid, "queue_state": "active"})
    if not result.ok:
        return _json(result.error_body())
    return Response(await gateway.tinker.payload(result.payload), media_type=result.media_type)


async def _sees_run(request: Request, model_id: str | None) -> bool:
    """Whether the request's key may read a training future of run ``model_id`` (auth/tenancy.py);
    a future that names no run is only for a request that sees everything."""
    tenant = tenant_of(request)
    if tenant is None:
        return True
    model = await gateway_of(request).tinker.store.model(model_id) if model_id else None
    return model is not None and sees(tenant, model.owner)


def _json(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body), media_type="application/json")
