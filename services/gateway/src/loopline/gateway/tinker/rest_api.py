"""The Tinker API's REST routes beside the training loop: training runs, their checkpoints (list,
delete), what a checkpoint adapts (``weights_info``, which the cookbook reads for its renderer),
the served models (``get_server_capabilities``) and ``healthz``. Answers are the SDK's types.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from loopline.common.contracts import tinker_names
from loopline.common.contracts.tinker_schemas import TinkerCheckpoint, TinkerModel
from loopline.gateway.auth.scopes import ANY_KEY, OPEN, TRAINING
from loopline.gateway.auth.tenancy import sees, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import check_page
from loopline.gateway.core.route_spec import FIELDS, PAGE, declare
from loopline.gateway.gateway import gateway_of
from loopline.gateway.tinker.bodies import json_object
from loopline.gateway.tinker.statuses import BODY

router = APIRouter(prefix="/api/v1")

KIND_OF_TYPE = {"training": "weights", "sampler": "sampler_weights"}


def _time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def checkpoint_body(c: TinkerCheckpoint) -> dict[str, Any]:
    return {"checkpoint_id": f"{KIND_OF_TYPE[c.checkpoint_type]}/{c.name}",
            "checkpoint_type": c.checkpoint_type, "time": _time(c.created_at), "tinker_path": c.tinker_path,
            "size_bytes": c.size_bytes,
            "public": False, "expires_at": _time(c.expires_at) if c.expires_at else None}


def run_body(model: TinkerModel, checkpoints: list[TinkerCheckpoint]) -> dict[str, Any]:
    last = {t: max((c for c in checkpoints if c.checkpoint_type == t), key=lambda c: c.created_at,
                   default=None) for t in KIND_OF_TYPE}
    return {"training_run_id": model.model_id, "base_model": model.model_name,
            "model_owner": model.session_id,
            "is_lora": True, "corrupted": model.state == "failed", "lora_rank": model.lora.rank,
            "last_request_time": _time(model.last_request_at),
            "last_checkpoint": checkpoint_body(last["training"]) if last["training"] else None,
            "last_sampler_checkpoint": checkpoint_body(last["sampler"]) if last["sampler"] else None,
            "user_metadata": model.user_metadata or None}


@router.get("/training_runs", **declare(TRAINING, {400: PAGE, 422: FIELDS}))
async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    check_page(limit, offset, gateway_of(request).settings.max_list_limit)
    store = gateway_of(request).tinker.store
    tenant = tenant_of(request)
    models = sorted((m for m in await store.models() if sees(tenant, m.owner)), key=lambda m: m.created_at,
                    reverse=True)
    page = models[offset: offset + limit]
    runs = [run_body(m, await store.checkpoints(m.model_id)) for m in page]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}}


@router.get("/training_runs/{run_id}", **declare(TRAINING, {404: "no such training run"}))
async def get_training_run(request: Request, run_id: str) -> dict[str, Any]:
    tinker = gateway_of(request).tinker
    model = await tinker.model(run_id, tenant_of(request))
    return run_body(model, await tinker.store.checkpoints(model.model_id))


@router.get("/training_runs/{run_id}/checkpoints", **declare(TRAINING, {404: "no such training run"}))
async def list_checkpoints(request: Request, run_id: str) -> dict[str, Any]:
    tinker = gateway_of(request).tinker
    model = await tinker.model(run_id, tenant_of(request))
    return {"checkpoints": [checkpoint_body(c) for c in await tinker.store.checkpoints(model.model_id)]}


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", **declare(TRAINING, {
    400: "the kind is not weights or sampler_weights", 404: "no such checkpoint"}))
async def delete_checkpoint(request: Request, run_id: str, kind: str, name: str) -> dict[str, Any]:
    """Forget the checkpoint: it is no longer listed, loadable or sampleable. Its files stay where
    they are until the run's directory is removed (a replica may be serving them right now)."""
    tinker = gateway_of(request).tinker
    if kind not in tinker_names.STATE_KINDS:
        raise ApiError(400, f"the kind must be one of {', '.join(tinker_names.STATE_KINDS)}", param="kind")
    if await tinker.checkpoint(run_id, kind, name, tenant_of(request)) is None:
        raise ApiError(404, f"no checkpoint {kind}/{name} in training run {run_id}")
    await tinker.store.delete_checkpoint(run_id, kind, name)
    return {}


@router.post("/weights_info", **declare(TRAINING, {
    400: f"{BODY}; not a tinker path", 404: "no such checkpoint"}))
async def weights_info(request: Request) -> dict[str, Any]:
    path = (await json_object(request)).get("tinker_path")
    try:
        parsed = tinker_names.parse_path(str(path))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tinker_path") from None
    tinker = gateway_of(request).tinker
    if await tinker.checkpoint(parsed.model_id, parsed.kind, parsed.name, tenant_of(request)) is None:
        raise ApiError(404, f"no checkpoint {path}", param="tinker_path")
    model = await tinker.model(parsed.model_id)
    return {"base_model": model.model_name, "is_lora": True, "lora_rank": model.lora.rank,
            "train_unembed": model.lora.train_unembed, "train_mlp": model.lora.train_mlp,
            "train_attn": model.lora.train_attn}


@router.get("/sessions", **declare(TRAINING, {400: PAGE, 422: FIELDS}))
async def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    check_page(limit, offset, gateway_of(request).settings.max_list_limit)
    tenant = tenant_of(request)
    sessions = [s for s in await gateway_of(request).tinker.store.sessions() if sees(tenant, s.owner)]
    sessions.sort(key=lambda s: s.created_at, reverse=True)
    return {"sessions": [s.session_id for s in sessions[offset: offset + limit]]}


@router.get("/sessions/{session_id}", **declare(TRAINING, {404: "no such session"}))
async def get_session(request: Request, session_id: str) -> dict[str, Any]:
    store = gateway_of(request).tinker.store
    session = await gateway_of(request).tinker.session(session_id, tenant_of(request))
    if session is None:
        raise ApiError(404, f"no session {session_id!r}", param="session_id")
    runs = sorted((m for m in await store.models() if m.session_id == session_id), key=lambda m: m.created_at)
    return {"training_run_ids": [m.model_id for m in runs], "sampler_ids": [],
            "user_metadata": session.user_metadata or None}


@router.get("/get_server_capabilities", **declare(ANY_KEY))
async def get_server_capabilities(request: Request) -> dict[str, Any]:
    directory = gateway_of(request).models
    await directory.refresh()
    return {"supported_models": [
        {"model_name": info.model, "max_context_length": info.max_model_len,
         "trainable": info.max_adapter_rank is not None and "generate" in info.tasks,
         "sampleable": "generate" in info.tasks}
        for info in directory.served.values()]}


@router.get("/healthz", **declare(OPEN))
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}
