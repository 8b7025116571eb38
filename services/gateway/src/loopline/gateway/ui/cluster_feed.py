"""What every dashboard page shows of the cluster, the same for every key: deployments and their
replicas (each replica's own status answer: engine, requests in flight, the adapter versions it has
loaded) and the queue's figures with live rates.

Read at most once per ``refresh_s`` for all open pages together (``snapshot``): a gateway with a
hundred pages open asks the replicas and the queue as often as with one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import QueueMetrics, ServiceStatus
from loopline.gateway.core.model_directory import ModelDirectory
from loopline.gateway.core.service_calls import ServiceCalls

log = logging.getLogger(__name__)

# Every replica answers $SRV.STATS; those that have not within this long are left out
# of this snapshot (a replica busy loading a model answers in tens of milliseconds here).
SCATTER_S = 0.4
QUEUE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Replica:
    replica: str
    deployment: str
    model: str
    engine: str  # "up", or why the engine is not
    in_flight: int
    served: int
    adapters: dict[str, int]  # job hash -> the step of the version it has loaded


@dataclass(frozen=True)
class Deployment:
    name: str
    model: str
    max_model_len: int
    tasks: list[str]
    replicas: list[Replica]
    unserved_for_s: float  # how long no replica has answered (0 while one does)


@dataclass(frozen=True)
class QueueFigures:
    depth: int
    requests: int
    tokens: int
    failed: int
    requests_per_s: float | None  # since the snapshot before (None at the first)
    tokens_per_s: float | None


@dataclass(frozen=True)
class Cluster:
    at: float
    deployments: list[Deployment]
    queue: QueueFigures | None
    queue_error: str | None
    adapter_replicas: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> replica -> step


class ClusterFeed:
    def __init__(self, nc: NATS, services: ServiceCalls, models: ModelDirectory, refresh_s: float):
        self.nc = nc
        self.services = services
        self.models = models
        self.refresh_s = refresh_s
        self._last: Cluster | None = None
        self._last_queue: tuple[float, QueueMetrics] | None = None
        self._reading: asyncio.Lock = asyncio.Lock()

    async def snapshot(self) -> Cluster:
        """The cluster as of at most ``refresh_s`` ago."""
        async with self._reading:  # one read at a time; the pages waiting get its result
            last = self._last
            if last is None or time.monotonic() - last.at >= self.refresh_s * 0.9:
                last = self._last = await self._read()
            return last

    async def _read(self) -> Cluster:
        statuses, (queue, queue_error) = await asyncio.gather(self._replica_statuses(), self._queue())
        by_deployment: dict[str, list[Replica]] = {}
        adapter_replicas: dict[str, dict[str, int]] = {}
        for status in statuses:
            detail = status.detail
            deployment = str(detail.get("deployment") or detail.get("model") or "?")
            adapters = {str(k): int(v) for k, v in (detail.get("adapters") or {}).items()}
            by_deployment.setdefault(deployment, []).append(Replica(
                replica=status.replica, deployment=deployment, model=str(detail.get("model", "")),
                engine=str(detail.get("engine_state", "up")), in_flight=int(detail.get("in_flight", 0)),
                served=int(detail.get("served", 0)), adapters=adapters))
            for job, step in adapters.items():
                adapter_replicas.setdefault(job, {})[status.replica] = step
        deployments = []
        for info in sorted(self.models.served.values(), key=lambda i: i.deployment):
            replicas = sorted(by_deployment.pop(info.deployment, []), key=lambda r: r.replica)
            deployments.append(Deployment(
                info.deployment, info.model, info.max_model_len, list(info.tasks), replicas,
                0.0 if replicas else self.models.unserved_for(info)))
        for name, replicas in sorted(by_deployment.items()):  # answering, not in MODELS yet
            deployments.append(Deployment(name, replicas[0].model, 0, [], replicas, 0.0))
        return Cluster(time.monotonic(), deployments, queue, queue_error, adapter_replicas)

    async def _replica_statuses(self) -> list[ServiceStatus]:
        """Every replica's status, from ``$SRV.STATS`` (which every instance answers, where the status
        endpoint reaches one of its queue group): the runtime puts it in the endpoint's ``data``."""
        inbox = self.nc.new_inbox()
        answers: list[ServiceStatus] = []

        async def collect(msg: Msg) -> None:
            try:
                stats = json.loads(msg.data)
                answers.extend(ServiceStatus.model_validate(e["data"]) for e in stats.get("endpoints", [])
                               if isinstance(e, dict) and e.get("data"))
            except (ValueError, TypeError, AttributeError):  # NATS's empty "no responders", or not stats
                pass

        try:
            sub = await self.nc.subscribe(inbox, cb=collect)
            try:
                await self.nc.publish(f"$SRV.STATS.{subjects.INFERENCE_SERVICE}", b"", reply=inbox)
                await asyncio.sleep(SCATTER_S)
            finally:
                await sub.unsubscribe()
        except Exception as exc:  # noqa: BLE001 - NATS down: no replica known
            log.info("could not ask the replicas: %s", exc)
        return answers

    async def _queue(self) -> tuple[QueueFigures | None, str | None]:
        try:
            metrics = await self.services.ask_queue(subjects.SVC_QUEUE_METRICS, QueueMetrics, QUEUE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no queue service, or slow: say so on the page
            return None, str(getattr(exc, "message", None) or exc) or type(exc).__name__
        now = time.monotonic()
        rates: tuple[float | None, float | None] = (None, None)
        if self._last_queue is not None:
            then, before = self._last_queue
            elapsed = max(now - then, 1e-6)
            rates = (max(0, metrics.requests - before.requests) / elapsed,
                     max(0, metrics.tokens - before.tokens) / elapsed)
        self._last_queue = (now, metrics)
        figures = QueueFigures(metrics.queue_depth, metrics.requests, metrics.tokens, metrics.failed, *rates)
        return figures, None


