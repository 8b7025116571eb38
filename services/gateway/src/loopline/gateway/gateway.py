"""The gateway's parts, each with one role, all on one NATS connection; the routes reach them through
``gateway_of(request)``.

The gateway owns nothing persistent. A request is accepted once JetStream has acked its work items;
from then on its answer lives in RESULTS, where any gateway can find it by subject.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from loopline.common.config.settings import GatewaySettings
from loopline.gateway.core.adapters import AdapterRegistry
from loopline.gateway.core.admission import Admission
from loopline.gateway.core.answers import Answers
from loopline.gateway.core.event_streams import StreamSlots
from loopline.gateway.core.limits import RateQuota, WindowQuota
from loopline.gateway.core.model_directory import ModelDirectory
from loopline.gateway.core.results import Results
from loopline.gateway.core.service_calls import ServiceCalls
from loopline.gateway.core.trainer_client import TrainerClient
from loopline.gateway.core.work import WorkPublisher
from loopline.gateway.tinker.part import TinkerPart
from loopline.gateway.ui.feeds import DashboardFeeds


class Gateway:
    def __init__(self, nc: NATS, js: JetStreamContext, settings: GatewaySettings):
        self.settings = settings
        # svc.trainer.*, datasets, job events
        self.trainer = TrainerClient(nc, js, settings.trainer_timeout_s)
        self.adapters = AdapterRegistry(js)  # which training jobs replicas have loaded
        self.services = ServiceCalls(nc)  # the queue's svc.queue.*, $SRV.PING for /v1/health
        self.models = ModelDirectory(  # model -> Route
            js, settings.model, self.adapters, self.trainer, census=self.services.live_deployments,
            grace_s=settings.replica_grace_s)
        self.admission = Admission(nc, settings.retry_after_s)  # queue depth -> 429
        self.work = WorkPublisher(js, settings.retry_after_s)  # work items and batch manifests
        self.results = Results(nc, js)  # stored results, waiters, token streams
        self.answers = Answers(nc)  # this gateway's answers.<id>.* subscription
        self.tinker = TinkerPart(nc, js, self.models)  # Tinker sessions, calls, futures
        self.streams = StreamSlots(settings.max_streams_per_key)  # open event streams per key
        # Tinker sessions and sampling sessions created per key (their buckets' TTL is the window)
        self.session_quota = WindowQuota(settings.max_tinker_sessions_per_key,
                                         settings.tinker_sessions_max_age_s, "max_tinker_sessions_per_key",
                                         "Tinker sessions and sampling sessions",
                                         max_holders=settings.max_tracked_clients)
        # run metrics posted per key, keys or none: each is an EVENTS message every live page hears
        self.metrics_quota = RateQuota(settings.run_metrics_per_minute, "run_metrics_per_minute",
                                       "run metrics posts", max_holders=settings.max_tracked_clients)
        # the dashboard's (/ui) view of the cluster and the newest events, shared by its pages
        self.ui = DashboardFeeds(nc, js, self.services, self.models, self.trainer, self.tinker.store.models,
                                 settings.ui_refresh_s, settings.ui_event_refresh_s)
        self.js = js

    async def start(self) -> None:
        """Subscribe and make the first reads; the gateway can route requests once this returns."""
        await self.admission.start()
        await self.answers.start()
        await self.work.start()
        await self.models.start()
        await self.adapters.start()
        await self.tinker.start()
        await self.ui.start()

    async def stop(self) -> None:
        await self.ui.stop()
        await self.adapters.stop()

    def status_detail(self) -> dict[str, Any]:
        """What svc.gateway.status reports beside the replica."""
        return {
            "models": sorted(self.models.served),
            "adapters_deployed": len(self.adapters.served),
            "answers": self.answers.gateway,
        }


def gateway_of(request: Request) -> Gateway:
    """The running gateway's parts, for a route."""
    return request.app.state.gateway
