"""The queue's request-reply endpoints (nats.micro): metrics and clear, beside the runtime's status.

Every queue replica registers them under one queue group, so each request is answered once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.js import JetStreamContext
from nats.micro.request import Request
from nats.micro.service import Service
from sqlalchemy import Engine

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ClearQueueReply
from loopline.queue import ledger
from loopline.queue.admission import Admission
from loopline.queue.clear import clear_queue
from loopline.queue.metrics import queue_depth, queue_metrics


class Endpoints:
    def __init__(self, js: JetStreamContext, engine: Engine, admission: Admission) -> None:
        self._js = js
        self._engine = engine
        self._admission = admission
        # One clear at a time: two at once would race to cancel the same prompts (harmlessly, but
        # both would report them).
        self._clearing = asyncio.Lock()

    async def add_to(self, service: Service) -> None:
        await service.add_endpoint(name="metrics", subject=subjects.SVC_QUEUE_METRICS, handler=self.metrics)
        await service.add_endpoint(name="clear", subject=subjects.SVC_QUEUE_CLEAR, handler=self.clear)

    async def metrics(self, req: Request) -> None:
        totals = await asyncio.to_thread(ledger.totals, self._engine)
        reply = queue_metrics(totals, self._admission.latest)
        await req.respond(reply.model_dump_json(by_alias=True).encode())

    async def clear(self, req: Request) -> None:
        async with self._clearing:
            cleared = await clear_queue(self._js)
        await req.respond(ClearQueueReply(cleared=cleared).model_dump_json().encode())

    def status_detail(self) -> dict[str, Any]:
        """What svc.queue.status reports beside the replica: the admission state last published."""
        state = self._admission.latest
        return {
            "queue_depth": queue_depth(state),
            "max_depth": state.max_depth if state else None,
            "deployments": {k: v.model_dump() for k, v in state.deployments.items()} if state else {},
        }
