"""Calls to the platform's other services over NATS, for the routes that only pass an answer on:
the queue's request-reply API (svc.queue.metrics and .clear, through loopline.common.runtime.service_client
like the trainer's), and a census of every running instance of a service (``$SRV.PING.<name>``, for
/v1/health). The trainer has its own client (trainer_client.py).
"""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from loopline.common.contracts import subjects
from loopline.common.runtime.service_client import Reply, ServiceClient, ServiceError
from loopline.gateway.core.errors import from_service_error

# The queue answers metrics from its last admission state and the ledger's totals.
QUEUE_TIMEOUT_S = 5.0


class ServiceCalls:
    def __init__(self, nc: NATS):
        self.nc = nc
        self.queue = ServiceClient(nc, "queue service", QUEUE_TIMEOUT_S)

    async def ask_queue(self, subject: str, reply: type[Reply], timeout_s: float | None = None) -> Reply:
        """The queue's answer as ``reply``: 503 when no queue service runs, 504 when it is too slow."""
        try:
            return await self.queue.call(subject, None, reply, timeout_s)
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    async def ping(self, service: str, wait_s: float = 0.25) -> list[dict]:
        """Every running instance of a nats.micro service, from ``$SRV.PING.<name>``."""
        inbox = self.nc.new_inbox()
        replies: list[dict] = []

        async def collect(msg: Msg) -> None:
            if msg.data:  # an empty one is NATS's "no responders" status: none is running
                replies.append(json.loads(msg.data))

        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
            await asyncio.sleep(wait_s)
        finally:
            await sub.unsubscribe()
        return replies

    async def live_deployments(self) -> set[str]:
        """The deployments with an inference replica answering now (each replica's service
        metadata names its deployment)."""
        # Longer than /v1/health's wait: a replica busy generating may answer a little late.
        instances = await self.ping(subjects.INFERENCE_SERVICE, wait_s=0.5)
        return {str(meta["deployment"]) for i in instances
                if isinstance(meta := i.get("metadata"), dict) and meta.get("deployment")}
