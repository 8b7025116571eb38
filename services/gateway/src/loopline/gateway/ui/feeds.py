"""What the gateway keeps for its dashboard pages, shared by all of them: the cluster's state and
the newest events."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from loopline.gateway.core.model_directory import ModelDirectory
from loopline.gateway.core.service_calls import ServiceCalls
from loopline.gateway.ui.cluster_feed import ClusterFeed
from loopline.gateway.ui.event_feed import EventFeed


class DashboardFeeds:
    def __init__(self, nc: NATS, js: JetStreamContext, services: ServiceCalls, models: ModelDirectory,
                 refresh_s: float):
        self.refresh_s = refresh_s
        self.cluster = ClusterFeed(nc, services, models, refresh_s)
        self.events = EventFeed(js)

    async def start(self) -> None:
        await self.events.start()

    async def stop(self) -> None:
        await self.events.stop()
