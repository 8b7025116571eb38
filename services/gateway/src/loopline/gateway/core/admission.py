"""Admission: whether a deployment's queue has room for a request's prompts, or a 429.

The queue service publishes each deployment's depth on ``queue.state`` a few times a second
(the queue service's admission.py); the gateway admits against the latest of these plus what it admitted
itself since, instead of asking JetStream on every request.
"""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import Counter

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import QueueState
from loopline.gateway.core.errors import ApiError

# A queue state older than this is ignored (the queue service is down): admit, JetStream still
# bounds the stream.
QUEUE_STATE_STALE_S = 5.0

REJECTED = Counter("loopline_gateway_admission_rejections", (
    "Requests answered 429 because their deployment's queue was full, by deployment."), ["deployment"])


class Admission:
    def __init__(self, nc: NATS, retry_after_s: int):
        self.nc = nc
        self.retry_after_s = retry_after_s  # what a 429 tells the client to wait
        self.queue_state: QueueState | None = None
        # deployment key -> prompts admitted here since the queue state above was published.
        self._admitted_since_state: dict[str, int] = {}

    async def start(self) -> None:
        await self.nc.subscribe(subjects.QUEUE_STATE, cb=self._on_queue_state)

    async def _on_queue_state(self, msg: Msg) -> None:
        self.queue_state = QueueState.model_validate_json(msg.data)
        self._admitted_since_state.clear()

    def admit(self, deployment: str, count: int) -> None:
        """Count ``count`` prompts for the deployment (its key), or raise a 429 if they do not fit."""
        state = self.queue_state
        if state is None or time.time() - state.at > QUEUE_STATE_STALE_S:
            return
        load = state.deployments.get(deployment)
        depth = (load.depth if load else 0) + self._admitted_since_state.get(deployment, 0)
        if depth + count > state.max_depth:
            REJECTED.labels(deployment).inc()
            raise ApiError(
                429,
                f"the queue for this model is full ({depth} requests waiting or running, limit "
                f"{state.max_depth}); retry after {self.retry_after_s} s",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self._admitted_since_state[deployment] = self._admitted_since_state.get(deployment, 0) + count
