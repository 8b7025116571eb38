"""Which models the gateway serves, and where a request's ``model`` goes: a Route.

Base models come from the MODELS bucket, where each inference deployment describes itself
(DeploymentInfo); the bucket is re-read every MODELS_REFRESH_S, and at once when a request names a
model not known yet. Training jobs' adapters come from the AdapterRegistry (adapters.py). A name
that resolves to nothing is a 404 that says, as precisely as the gateway can tell, why.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from loopline.common import subjects
from loopline.common.job_hash import is_job_hash
from loopline.common.runtime import pause
from loopline.common.schemas import DeploymentInfo
from loopline.gateway.adapters import AdapterRegistry, ServedAdapter
from loopline.gateway.errors import ApiError
from loopline.gateway.trainer_client import TrainerClient

log = logging.getLogger(__name__)

# How often the model registry is re-read; a miss also re-reads it at once.
MODELS_REFRESH_S = 2.0
# How long the 404 for a job hash waits for the trainer to say whether it knows the job.
JOB_LOOKUP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Route:
    """Where a request's ``model`` goes: a deployment, and on it the base model or a job's adapter."""

    info: DeploymentInfo
    model: str  # the name the client used (a job hash for an adapter; ``latest`` resolved)
    adapter: str | None = None  # the job hash whose newest adapter generates
    step: int | None = None  # the adapter's newest step some replica loaded

    @property
    def deployment(self) -> str:
        """The deployment's key: its work subject and its entry in the queue's admission state."""
        return self.info.deployment

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len


class ModelDirectory:
    def __init__(self, js: JetStreamContext, default_model: str, adapters: AdapterRegistry,
                 trainer: TrainerClient):
        self.js = js
        self.default_model = default_model  # what a request that names no model gets
        self.adapters = adapters
        self.trainer = trainer
        # model name -> its deployment, as of the last successful read of the bucket.
        self.served: dict[str, DeploymentInfo] = {}
        self.bucket: KeyValue | None = None  # MODELS, opened by start()

    async def start(self) -> None:
        self.bucket = await self.js.key_value(subjects.MODELS_BUCKET)
        await self.refresh()

    async def refresh(self) -> None:
        """Re-read the served models. A read that fails for another reason than "nothing there"
        (NATS busy or reconnecting) keeps what we knew: under load a timed-out ``keys()`` used to
        empty the registry, and requests for a served model got 404 until the next refresh."""
        assert self.bucket is not None, "start() first"
        try:
            keys = await self.bucket.keys()
        except NoKeysError:
            # nats-py's keys() can say "none" while the bucket has some: its watcher signals the
            # end when the consumer has nothing pending but before the delivered messages are
            # counted, which happens under load. Believe "none" only when the bucket holds nothing:
            # emptying the registry answered every request 404 for a refresh interval.
            if await self._holds_values():
                return
            keys = []
        except Exception as exc:  # noqa: BLE001 - keep the last known registry
            log.debug("model refresh failed: %s", exc)
            return
        known = {info.deployment: info for info in self.served.values()}
        served = {}
        for key in keys:
            try:
                info = DeploymentInfo.model_validate_json((await self.bucket.get(key)).value or b"")
            except KeyNotFoundError:  # deleted between keys() and get()
                continue
            except Exception as exc:  # noqa: BLE001 - unreadable now: keep what we had for it
                log.debug("reading model %s failed: %s", key, exc)
                kept = known.get(key)
                if kept is None:
                    continue
                info = kept
            served[info.model] = info
        self.served = served

    async def _holds_values(self) -> bool:
        """Whether MODELS holds any entry (or cannot say: then assume it does)."""
        assert self.bucket is not None, "start() first"
        try:
            return (await self.bucket.status()).values > 0
        except Exception as exc:  # noqa: BLE001 - NATS busy: keep what we knew
            log.debug("model bucket status failed: %s", exc)
            return True

    async def run(self, stopping: asyncio.Event) -> None:
        """The ``models`` loop: re-read the bucket every MODELS_REFRESH_S until told to stop."""
        # Invariant: ``served`` is never older than MODELS_REFRESH_S plus one read, unless NATS
        # fails us; then it holds the last models we knew, rather than none.
        while not await pause(stopping, MODELS_REFRESH_S):
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - NATS down: keep the last known registry
                log.debug("model refresh failed: %s", exc)

    async def resolve(self, name: str | None) -> Route:
        """Where ``model`` goes: a served model by name (``None``: the default model), a job hash
        (its newest loaded adapter on the job's base model) or ``latest`` (the job loaded last)."""
        name = name or self.default_model
        # A deployed job hash is not a model name: no need to re-read the models for it.
        if name not in self.served and not self.adapters.deployed(name):
            await self.refresh()
        if name in self.served:
            return Route(self.served[name], name)
        if name == self.default_model and len(self.served) == 1:
            return Route(next(iter(self.served.values())), name)
        if name == "latest":
            adapter = self.adapters.latest(set(self.served))
        else:
            adapter = await self.adapters.find(name)
        if adapter is not None and adapter.base_model in self.served:
            return Route(self.served[adapter.base_model], adapter.job_hash, adapter.job_hash, adapter.step)
        # vLLM's own type for an unknown model, so clients that match on it behave as with vllm serve.
        raise ApiError(404, await self._not_served(name, adapter), param="model", type="NotFoundError")

    async def _not_served(self, name: str, adapter: ServedAdapter | None) -> str:
        """Why ``name`` is not servable, as precisely as we can tell (this is the error path)."""
        if adapter is not None:
            return f"job {name} adapts {adapter.base_model!r}, which no inference replica serves now"
        if name == "latest":
            return "no training job has a deployed adapter yet"
        known = ", ".join(sorted(self.served)) or "none yet"
        if name in self.adapters.rejected:
            return f"job {name} is not deployed: {self.adapters.rejected[name]}"
        if is_job_hash(name):
            try:
                job = await self.trainer.get(name, timeout_s=JOB_LOOKUP_TIMEOUT_S)
            except ApiError:  # unknown job (404), trainer down or slow: not a job we know
                job = None
            if job is not None:
                return (f"job {name} is not deployed yet ({job.status.value}, step {job.step} of "
                        f"{job.max_steps}): it is served once a replica has loaded a checkpoint of it")
        return f"The model `{name}` does not exist. Served models: {known}."
