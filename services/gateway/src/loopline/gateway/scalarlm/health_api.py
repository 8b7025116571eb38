"""/v1/health: which services answer, learned over NATS (nats.micro PING), in ScalarLM's shape."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from loopline.common.contracts import subjects
from loopline.gateway.auth.scopes import ANY_KEY, OPEN
from loopline.gateway.core.route_spec import declare
from loopline.gateway.gateway import gateway_of

router = APIRouter(prefix="/v1/health")

# ScalarLM's keys for the roles, then ours.
ROLES = {
    "vllm": subjects.INFERENCE_SERVICE,
    "megatron": subjects.TRAINER_SERVICE,
    "queue": subjects.QUEUE_SERVICE,
    "checkpoint_watcher": subjects.CHECKPOINT_WATCHER_SERVICE,
    "gateway": subjects.GATEWAY_SERVICE,
}
# What the serving path needs; the others are reported but do not make the platform "down".
REQUIRED = ("vllm", "queue")


@router.get("", **declare(ANY_KEY))  # the scalarlm client checks it before anything else
async def health(request: Request):
    services = gateway_of(request).services
    try:
        replies = await asyncio.gather(*(services.ping(name) for name in ROLES.values()))
    except Exception as exc:  # noqa: BLE001 - NATS itself is down
        down = {"status": "down", "reason": f"message bus unreachable: {exc}"}
        return {"api": "up", **dict.fromkeys(ROLES, down), "all": "down", "services": {}}
    body: dict = {"api": "up"}
    instances_of = {}
    for (role, name), instances in zip(ROLES.items(), replies, strict=True):
        instances_of[role] = [{"id": i.get("id"), **(i.get("metadata") or {})} for i in instances]
        body[role] = "up" if instances else {"status": "down", "reason": f"no {name} instance answered"}
    up = [role for role in REQUIRED if body[role] == "up"]
    body["all"] = "up" if len(up) == len(REQUIRED) else ("mixed" if up else "down")
    body["services"] = instances_of
    return body


@router.get("/keepalive", **declare(OPEN))  # container health probes
async def keepalive():
    return {"status": "ok"}
