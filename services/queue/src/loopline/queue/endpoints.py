"""The queue's request-reply endpoints (nats.micro): metrics, clear, status.

Every queue replica registers them under one queue group, so each request is answered once.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service
from sqlalchemy import Engine

from loopline.common import subjects
from loopline.common.schemas import ClearQueueReply, ServiceStatus
from loopline.queue import ledger
from loopline.queue.admission import Admission
from loopline.queue.clear import clear_queue
from loopline.queue.metrics import queue_depth, queue_metrics

VERSION = "0.1.0"
# Not in loopline.common.subjects yet (it has svc.inference.status only).

class Endpoints:
    def __init__(
        self, nc: NATS, js: JetStreamContext, engine: Engine, admission: Admission, replica: str
    ) -> None:
        self._nc = nc
        self._js = js
        self._engine = engine
        self._admission = admission
        self._replica = replica
        # One clear at a time: two at once would race to cancel the same prompts (harmlessly, but
        # both would report them).
        self._clearing = asyncio.Lock()

    async def start(self) -> Service:
        service = await add_service(
            self._nc,
            name=subjects.QUEUE_SERVICE,
            version=VERSION,
            description="Loopline request ledger, admission state, dead letters and queue metrics",
        )
        await service.add_endpoint(name="metrics", subject=subjects.SVC_QUEUE_METRICS, handler=self.metrics)
        await service.add_endpoint(name="clear", subject=subjects.SVC_QUEUE_CLEAR, handler=self.clear)
        await service.add_endpoint(name="status", subject=subjects.SVC_QUEUE_STATUS, handler=self.status)
        return service

    async def metrics(self, req: Request) -> None:
        totals = await asyncio.to_thread(ledger.totals, self._engine)
        reply = queue_metrics(totals, self._admission.latest)
        await req.respond(reply.model_dump_json(by_alias=True).encode())

    async def clear(self, req: Request) -> None:
        async with self._clearing:
            cleared = await clear_queue(self._js)
        await req.respond(ClearQueueReply(cleared=cleared).model_dump_json().encode())

    async def status(self, req: Request) -> None:
        state = self._admission.latest
        detail = {
            "queue_depth": queue_depth(state),
            "max_depth": state.max_depth if state else None,
            "deployments": {k: v.model_dump() for k, v in state.deployments.items()} if state else {},
        }
        reply = ServiceStatus(service="queue", replica=self._replica, detail=detail)
        await req.respond(reply.model_dump_json().encode())
