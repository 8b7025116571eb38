"""Calls to the platform's other services over NATS, for the routes that only pass an answer on:
a request to one (the queue's svc.queue.metrics and .clear), and a census of every running instance
of one (``$SRV.PING.<name>``, for /v1/health). The trainer has its own client (trainer_client.py).
"""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from loopline.gateway.errors import ApiError


class ServiceCalls:
    def __init__(self, nc: NATS):
        self.nc = nc

    async def request(self, subject: str, payload: bytes = b"", timeout_s: float = 5.0) -> bytes:
        """The answer's bytes, or a 503 when nobody answers in time."""
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout_s)
        except Exception as exc:  # no responders, timeout, NATS down
            raise ApiError(503, f"{subject} did not answer ({type(exc).__name__}); "
                                "is the service running?") from exc
        return msg.data

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
