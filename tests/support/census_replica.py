"""A deployment served, as far as a gateway can tell, with no engine behind it: its MODELS entry,
and a replica answering the census ($SRV.PING of the inference service) for it. For gateway tests
that read listings and routing, not answers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from nats.micro import add_service

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.runtime import bus


@contextmanager
def census_replica(nats_url: str, info: DeploymentInfo, replica: str = "test-replica") -> Iterator[None]:
    """``info`` announced and one replica of it answering the census, until the block ends."""
    stop, ready = threading.Event(), threading.Event()

    async def run() -> None:
        nc = await bus.connect(nats_url, replica)
        js = nc.jetstream()
        await bus.ensure_topology(js)
        models = await js.key_value(subjects.MODELS_BUCKET)
        await models.put(info.deployment, info.model_dump_json().encode())
        await add_service(nc, name=subjects.INFERENCE_SERVICE, version="0.1.0",
                          metadata={"deployment": info.deployment, "replica": replica})
        ready.set()
        await asyncio.to_thread(stop.wait)
        await nc.close()

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(30), "the stand-in replica did not start"
        yield
    finally:
        stop.set()
        thread.join(10)
