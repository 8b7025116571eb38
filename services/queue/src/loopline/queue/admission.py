"""Admission state: how deep each deployment's queue is, published for the gateways to admit by.

The gateway answers 429 when a deployment's pending + in-flight prompts plus the new ones would
pass ``max_depth``; it reads the depth from the latest ``queue.state`` message instead of asking
JetStream on every request.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentLoad, QueueState
from loopline.common.runtime.service import pause
from loopline.queue.deployments import DeploymentDirectory

log = logging.getLogger(__name__)


class Admission:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        directory: DeploymentDirectory,
        *,
        max_depth: int,
        interval_s: float,
    ) -> None:
        self._nc = nc
        self._js = js
        self._directory = directory
        self._max_depth = max_depth
        self._interval_s = interval_s
        # The last state published; the metrics and status endpoints report from it.
        self.latest: QueueState | None = None

    async def run(self, stopping: asyncio.Event) -> None:
        # Invariant: every tick publishes one QueueState measured from scratch in that tick, so a
        # missed or failed tick leaves nothing stale behind but the previous message.
        while not stopping.is_set():
            try:
                state = await self.measure()
                self.latest = state
                await self._nc.publish(subjects.QUEUE_STATE, state.model_dump_json().encode())
            except Exception as exc:  # noqa: BLE001 - NATS may be reconnecting; next tick retries
                log.warning("measuring queue depth failed: %s", exc)
            await pause(stopping, self._interval_s)

    async def measure(self) -> QueueState:
        deployments = sorted(self._directory.keys())
        loads = await asyncio.gather(*(self._load(d) for d in deployments))
        return QueueState(deployments=dict(zip(deployments, loads, strict=True)), max_depth=self._max_depth)

    async def _load(self, deployment: str) -> DeploymentLoad:
        try:
            info = await self._js.consumer_info(subjects.WORK_STREAM, subjects.inference_durable(deployment))
        except NotFoundError:
            # No replica has created the consumer yet: nothing can be waiting on it either.
            return DeploymentLoad()
        return DeploymentLoad(pending=info.num_pending or 0, in_flight=info.num_ack_pending or 0)
