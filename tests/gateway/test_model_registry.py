"""The gateway's directory of served models survives a NATS read that fails under load."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoKeysError

from loopline.common.schemas import DeploymentInfo
from loopline.gateway.model_directory import ModelDirectory


class _Entry:
    def __init__(self, value: bytes):
        self.value = value


class _FlakyBucket:
    """Stands in for the MODELS bucket: answers, times out, holds nothing, or has nats-py's keys()
    say "no keys" while it holds some (its watcher's race under load), as told."""

    def __init__(self, infos: list[DeploymentInfo]):
        self.infos = {i.deployment: i for i in infos}
        self.fail_keys = False
        self.fail_get = False
        self.no_keys_said = False

    async def keys(self):
        if self.fail_keys:
            raise NatsTimeoutError()
        if not self.infos or self.no_keys_said:
            raise NoKeysError()
        return list(self.infos)

    async def status(self):
        return SimpleNamespace(values=len(self.infos))

    async def get(self, key):
        if self.fail_get:
            raise NatsTimeoutError()
        return _Entry(self.infos[key].model_dump_json().encode())


def test_failed_reads_keep_the_known_models_and_an_empty_bucket_empties_them():
    info = DeploymentInfo(model="tiny", deployment="tiny", max_model_len=256, engine="vllm")
    directory = ModelDirectory(js=None, default_model="tiny", adapters=None, trainer=None)
    bucket = _FlakyBucket([info])
    directory.bucket = bucket

    async def scenario() -> list[set[str]]:
        seen = []
        await directory.refresh()
        seen.append(set(directory.served))
        bucket.fail_keys = True  # keys() timing out used to empty the registry
        await directory.refresh()
        seen.append(set(directory.served))
        bucket.fail_keys, bucket.fail_get = False, True
        await directory.refresh()
        seen.append(set(directory.served))
        bucket.fail_get, bucket.no_keys_said = False, True  # emptied the registry under CI load
        await directory.refresh()
        seen.append(set(directory.served))
        bucket.no_keys_said = False
        bucket.infos = {}  # the replica is gone for good
        await directory.refresh()
        seen.append(set(directory.served))
        return seen

    assert asyncio.run(scenario()) == [{"tiny"}, {"tiny"}, {"tiny"}, {"tiny"}, set()]
