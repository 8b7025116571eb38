"""What the gateway keeps for its dashboard pages, shared by all of them: the cluster's state, the
newest events, and the list of jobs and runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from loopline.common.contracts.tinker_schemas import TinkerModel
from loopline.gateway.core.model_directory import ModelDirectory
from loopline.gateway.core.service_calls import ServiceCalls
from loopline.gateway.core.trainer_client import TrainerClient
from loopline.gateway.ui.cluster_feed import ClusterFeed
from loopline.gateway.ui.event_feed import EventFeed
from loopline.gateway.ui.listings import Listings


class DashboardFeeds:
    def __init__(self, nc: NATS, js: JetStreamContext, services: ServiceCalls, models: ModelDirectory,
                 trainer: TrainerClient, runs: Callable[[], Awaitable[list[TinkerModel]]], refresh_s: float,
                 event_refresh_s: float):
        self.refresh_s = refresh_s
        self.cluster = ClusterFeed(nc, services, models, refresh_s)
        self.events = EventFeed(js)
        # Every tenant's: each page shows its viewer's own.
        self.listings = Listings(trainer.list, runs, self.events, refresh_s, event_refresh_s)

    async def start(self) -> None:
        await self.events.start()

    async def stop(self) -> None:
        await self.listings.stop()
        await self.events.stop()
