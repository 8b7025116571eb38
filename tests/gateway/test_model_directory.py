"""The gateway's directory of served models against a real nats-server: it reads the MODELS bucket
without piling consumers onto it, keeps what it knew through a failed read, and tells the
deployments some replica serves from those only a MODELS entry remembers."""

from __future__ import annotations

import asyncio
import time

import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.local import launcher
from loopline.common.runtime import bus
from loopline.gateway.core import model_directory
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.model_directory import ModelDirectory
from support.nats import nats_server

SERVED = DeploymentInfo(model="tiny", deployment="tiny", max_model_len=256, engine="vllm")
GONE = DeploymentInfo(model="old", deployment="old", max_model_len=256, engine="vllm")


class Census:
    """The deployments whose replicas answer, as the test says (the real census pings replicas;
    tests/e2e/test_unserved_deployments.py runs it against real ones)."""

    def __init__(self) -> None:
        self.alive: set[str] = set()
        self.calls = 0

    async def __call__(self) -> set[str]:
        self.calls += 1
        return set(self.alive)


async def _directory(url: str, census: Census, grace_s: float) -> tuple[ModelDirectory, object]:
    nc = await bus.connect(url, "test-model-directory")
    js = nc.jetstream(timeout=2.0)
    await bus.ensure_topology(js)
    kv = await js.key_value(subjects.MODELS_BUCKET)
    for info in (SERVED, GONE):
        await kv.put(info.deployment, info.model_dump_json().encode())
    directory = ModelDirectory(js, "tiny", adapters=None, trainer=None, census=census, grace_s=grace_s)
    await directory.start()
    return directory, nc


def test_refreshing_leaves_no_consumer_and_a_failed_read_keeps_the_models(tmp_path):
    async def scenario(server) -> tuple[int, set[str], set[str]]:
        directory, nc = await _directory(server.info["url"], Census(), grace_s=60)
        for _ in range(50):
            await directory.refresh()
        consumers = (await directory.js.stream_info(f"KV_{subjects.MODELS_BUCKET}")).state.consumer_count
        read = set(directory.served)
        launcher.stop(server)  # every read now fails: the directory must not forget the models
        await directory.refresh()
        kept = set(directory.served)
        await nc.close()
        return consumers, read, kept

    with nats_server(tmp_path) as server:
        consumers, read, kept = asyncio.run(scenario(server))
    # nats-py's kv.keys() left one consumer per read (~150 piled up in a 15-minute fuzz run).
    assert consumers == 0
    assert read == kept == {"tiny", "old"}


def test_a_deployment_without_a_replica_is_unlisted_then_refused_with_503(tmp_path):
    census = Census()
    census.alive = {"tiny"}

    async def scenario(url: str) -> dict:
        directory, nc = await _directory(url, census, grace_s=1.0)
        seen: dict = {"listed": [i.model for i in directory.listed()]}
        # Within the grace period a request for the unserved model is still taken (queued).
        seen["old_at_once"] = (await directory.resolve("old")).deployment
        await asyncio.sleep(1.2)
        await directory.take_census()
        with pytest.raises(ApiError) as refused:
            await directory.resolve("old")
        seen["old_later"] = (refused.value.status, refused.value.headers, refused.value.message)
        seen["tiny"] = (await directory.resolve(None)).deployment  # the live one is served
        census.alive = set()  # its replica goes too
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            await asyncio.sleep(0.3)
            await directory.take_census()
        with pytest.raises(ApiError) as refused:
            await directory.resolve("tiny")
        seen["tiny_gone"] = refused.value.status
        census.alive = {"tiny"}  # a replica comes back: served again at once
        await directory.take_census()
        seen["tiny_back"] = (await directory.resolve("tiny")).deployment
        await nc.close()
        return seen

    with nats_server(tmp_path) as server:
        seen = asyncio.run(scenario(server.info["url"]))
    assert seen["listed"] == ["tiny"]
    assert seen["old_at_once"] == "old"
    status, headers, message = seen["old_later"]
    assert status == 503 and int(headers["Retry-After"]) > 0
    assert "'old'" in message and "tiny" in message  # which model, and what is served instead
    assert seen["tiny"] == "tiny"
    assert seen["tiny_gone"] == 503
    assert seen["tiny_back"] == "tiny"


def test_listing_asks_the_replicas_again_only_for_a_deployment_announced_lately(tmp_path, monkeypatch):
    monkeypatch.setattr(model_directory, "LISTED_FOR_S", 1.0)
    census = Census()
    census.alive = {"tiny"}

    async def scenario(url: str) -> tuple[int, int, list[str]]:
        directory, nc = await _directory(url, census, grace_s=60)
        census.calls = 0
        await directory.refresh_listing()  # "old" was announced just now: worth asking again
        lately = census.calls
        await asyncio.sleep(1.2)
        await directory.take_census()
        census.calls = 0
        listed = await directory.refresh_listing()  # "old" has been unserved a while: no wait
        await nc.close()
        return lately, census.calls, [info.model for info in listed]

    with nats_server(tmp_path) as server:
        lately, later, listed = asyncio.run(scenario(server.info["url"]))
    assert (lately, later, listed) == (1, 0, ["tiny"])
