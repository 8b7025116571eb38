"""The test's own look at NATS from synchronous tests (httpx, the scalarlm client, the CLI runner):
one short connection per question. What the trainer received is read here from what it made of it:
the ``datasets`` object store and its own svc.trainer.* answers (through the client the gateway uses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.js.api import ObjectInfo
from pydantic import BaseModel

from loopline.common.contracts import subjects
from loopline.common.runtime import bus
from loopline.common.runtime.service_client import ServiceClient

T = TypeVar("T")
Reply = TypeVar("Reply", bound=BaseModel)


class BusView:
    def __init__(self, nats_url: str, name: str = "test-view"):
        self.nats_url, self.name = nats_url, name

    def ask(self, question: Callable[[NATS], Awaitable[T]]) -> T:
        """``question(nc)`` on a connection of its own, from synchronous code."""
        async def go() -> T:
            nc = await bus.connect(self.nats_url, self.name)
            try:
                return await question(nc)
            finally:
                await nc.close()

        return asyncio.run(go())

    def dataset_info(self, name: str) -> ObjectInfo:
        """The ``datasets`` object's info (its nuid changes when it is written again)."""
        async def info(nc: NATS) -> ObjectInfo:
            return await (await nc.jetstream().object_store(subjects.DATASETS_BUCKET)).get_info(name)

        return self.ask(info)

    def dataset(self, name: str) -> bytes:
        async def get(nc: NATS) -> bytes:
            data = (await (await nc.jetstream().object_store(subjects.DATASETS_BUCKET)).get(name)).data
            assert data is not None
            return data

        return self.ask(get)

    def ask_trainer(self, subject: str, body: BaseModel | None, reply: type[Reply]) -> Reply:
        """The trainer's own answer, through the client the gateway uses."""
        return self.ask(lambda nc: ServiceClient(nc, "trainer", 10).call(subject, body, reply))
