"""Which models the gateway serves, and where a request's ``model`` goes: a Route.

Base models come from the MODELS bucket, where each inference deployment describes itself
(DeploymentInfo); the bucket is re-read every MODELS_REFRESH_S, and at once when a request names a
model not known yet. Training jobs' adapters come from the AdapterRegistry (adapters.py). A name
that resolves to nothing is a 404 that says, as precisely as the gateway can tell, why.

A MODELS entry outlives its replicas (a stack restarted with another model leaves the old one
there), so which deployments are alive is learned apart: every refresh counts the replicas that
answer ``$SRV.PING`` for the inference service, by the deployment in their metadata. ``/v1/models``
lists the deployments seen alive lately; a request for one no replica has served for the grace
period (LOOPLINE_REPLICA_GRACE_S) is answered 503 with Retry-After at once, where it used to be
queued and wait for an answer that could not come. What was queued before stays queued: a replica
that comes back serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import is_job_hash
from loopline.common.contracts.job_schemas import OwnerFilter
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.runtime import bus
from loopline.common.runtime.service import pause
from loopline.gateway.core.adapters import AdapterRegistry, ServedAdapter
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.job_owners import JobOwners
from loopline.gateway.core.trainer_client import TrainerClient

log = logging.getLogger(__name__)

# How often the model registry is re-read; a miss also re-reads it at once.
MODELS_REFRESH_S = 2.0
# How long the 404 for a job hash waits for the trainer to say whether it knows the job.
JOB_LOOKUP_TIMEOUT_S = 2.0
# /v1/models lists a deployment some replica answered for within this long: many refreshes, so
# pings answered late on a saturated machine (the chaos tests at load 11 on 2 cores saw an empty
# list once with 7 s) do not make a served model blink out of the list.
LISTED_FOR_S = 30.0
# The Retry-After of the 503 for a deployment nobody serves: a replica (re)starting takes longer
# than a queue's 2 s (vLLM loads the tiny model in ~20 s on 2 cores).
UNSERVED_RETRY_AFTER_S = 10

# The deployments that have a live replica now (the census: $SRV.PING of the inference service).
Census = Callable[[], Awaitable[set[str]]]


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
                 trainer: TrainerClient, census: Census, grace_s: float):
        self.js = js
        self.default_model = default_model  # what a request that names no model gets
        self.adapters = adapters
        self.trainer = trainer
        self.owners = JobOwners(trainer)  # whose each adapter is (a tenant sees its own)
        self.census = census
        self.grace_s = grace_s  # a deployment with no replica for this long is answered 503
        # model name -> its deployment, as of the last successful read of the bucket.
        self.served: dict[str, DeploymentInfo] = {}
        # deployment -> when (monotonic) a replica of it last answered the census.
        self.seen_at: dict[str, float] = {}
        # deployment -> when this gateway first read its MODELS entry: one never seen alive has been
        # unserved since then as far as it can tell (a new gateway, or a deployment just announced,
        # gives it the grace period rather than a 503 at once).
        self.known_at: dict[str, float] = {}
        self.bucket: KeyValue | None = None  # MODELS, opened by start()

    async def start(self) -> None:
        self.bucket = await self.js.key_value(subjects.MODELS_BUCKET)
        await self.refresh()
        await self.take_census()

    async def take_census(self) -> None:
        """Note which deployments have a replica answering now. A failed census notes nothing: the
        grace period then runs on, as it would if no replica answered."""
        try:
            alive = await self.census()
        except Exception as exc:  # noqa: BLE001 - NATS busy or reconnecting: ask again next time
            log.debug("replica census failed: %s", exc)
            return
        now = time.monotonic()
        for deployment in alive:
            self.seen_at[deployment] = now

    async def refresh_listing(self) -> list[DeploymentInfo]:
        """The bucket re-read, and the census taken again (0.5 s) when it holds a deployment announced
        lately and not seen alive yet: its replica just started, and the loop's census may be 2 s
        old. Not for an entry long unserved (a model the stack no longer runs): every listing would
        wait for it."""
        await self.refresh()
        now = time.monotonic()
        listed = self.listed()
        if any(info not in listed and now - self.known_at.get(info.deployment, now) <= LISTED_FOR_S
               for info in self.served.values()):
            await self.take_census()
            listed = self.listed()
        return listed

    def listed(self) -> list[DeploymentInfo]:
        """The deployments some replica answered for lately: what /v1/models shows."""
        now = time.monotonic()
        return [info for info in self.served.values()
                if now - self.seen_at.get(info.deployment, -LISTED_FOR_S) <= LISTED_FOR_S]

    def unserved_for(self, info: DeploymentInfo) -> float:
        """How long no replica of ``info``'s deployment has answered, as far as we can tell."""
        now = time.monotonic()
        return now - self.seen_at.get(info.deployment, self.known_at.get(info.deployment, now))

    async def refresh(self) -> None:
        """Re-read the served models. A read that fails (NATS busy or reconnecting) keeps what we
        knew: under load a timed-out read used to empty the registry, and requests for a served
        model got 404 until the next refresh."""
        assert self.bucket is not None, "start() first"
        try:
            keys = await bus.kv_keys(self.js, subjects.MODELS_BUCKET)
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
            self.known_at.setdefault(info.deployment, time.monotonic())
        self.served = served

    async def deployment_of(self, name: str) -> DeploymentInfo | None:
        """The deployment serving the base model ``name`` (its served name, or the folder its
        replicas load), re-reading the registry once on a miss; None when none serves it."""
        for attempt in range(2):
            if attempt:
                await self.refresh()
            info = self.served.get(name) or next(
                (info for info in self.served.values() if info.model_path == name), None)
            if info is not None:
                return info
        return None

    async def run(self, stopping: asyncio.Event) -> None:
        """The ``models`` loop: re-read the bucket and take the census every MODELS_REFRESH_S
        until told to stop."""
        # Invariant: ``served`` and ``seen_at`` are never older than MODELS_REFRESH_S plus one read
        # each, unless NATS fails us; then they hold the last we knew, rather than nothing.
        while not await pause(stopping, MODELS_REFRESH_S):
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - NATS down: keep the last known registry
                log.debug("model refresh failed: %s", exc)
            await self.take_census()

    async def visible_adapters(self, tenant: OwnerFilter) -> list[ServedAdapter]:
        """The deployed adapters a request of ``tenant`` may see and use (auth/tenancy.py), in the
        order they were first loaded."""
        return [adapter for adapter in sorted(self.adapters.served.values(), key=lambda a: a.first_loaded_at)
                if await self.owners.visible(tenant, adapter.job_hash)]

    async def resolve(self, name: str | None, tenant: OwnerFilter = None) -> Route:
        """Where ``model`` goes: a served model by name (``None``: the default model), a job hash
        (its newest loaded adapter on the job's base model) or ``latest`` (the job loaded last).
        Adapters are ``tenant``'s own (auth/tenancy.py): another key's job hash is answered as an
        unknown model, and ``latest`` is the tenant's latest."""
        name = name or self.default_model
        # A deployed job hash is not a model name: no need to re-read the models for it.
        if name not in self.served and not self.adapters.deployed(name):
            await self.refresh()
        if name in self.served:
            return await self._alive(Route(self.served[name], name))
        listed = self.listed()
        if name == self.default_model and len(listed) == 1:
            return Route(listed[0], name)
        if name == "latest":
            bases = {info.model for info in listed} or set(self.served)
            adapter = max((a for a in await self.visible_adapters(tenant) if a.base_model in bases),
                          key=lambda a: a.first_loaded_at, default=None)
        else:
            adapter = await self.adapters.find(name)
            if adapter is not None and not await self.owners.visible(tenant, name):
                adapter = None
        if adapter is not None and adapter.base_model in self.served:
            base = self.served[adapter.base_model]
            return await self._alive(Route(base, adapter.job_hash, adapter.job_hash, adapter.step))
        # vLLM's own type for an unknown model, so clients that match on it behave as with vllm serve.
        why = await self._not_served(name, adapter, tenant)
        raise ApiError(404, why, param="model", type="NotFoundError")

    async def _alive(self, route: Route) -> Route:
        """``route``, unless no replica has served its deployment for the grace period: then a 503
        at once, rather than a request queued for nobody (what is queued already stays)."""
        if self.unserved_for(route.info) > self.grace_s:
            await self.take_census()  # the loop's census may be late (a busy gateway): ask now
        unserved_s = self.unserved_for(route.info)
        if unserved_s > self.grace_s:
            raise ApiError(503, (
                f"no inference replica has served {route.info.model!r} for {unserved_s:.0f} s (grace "
                f"period {self.grace_s:g} s): start one, or name a served model "
                f"({', '.join(sorted(i.model for i in self.listed())) or 'none now'})"),
                param="model", headers={"Retry-After": str(UNSERVED_RETRY_AFTER_S)})
        return route

    async def _not_served(self, name: str, adapter: ServedAdapter | None, tenant: OwnerFilter) -> str:
        """Why ``name`` is not servable, as precisely as we can tell (this is the error path); of
        another tenant's job, no more than of a name nobody uses."""
        if adapter is not None:
            return f"job {name} adapts {adapter.base_model!r}, which no inference replica serves now"
        if name == "latest":
            return "no training job has a deployed adapter yet"
        known = ", ".join(sorted(info.model for info in self.listed())) or "none now"
        if name in self.adapters.rejected and await self.owners.visible(tenant, name):
            return f"job {name} is not deployed: {self.adapters.rejected[name]}"
        if is_job_hash(name):
            try:
                job = await self.trainer.get(name, tenant, timeout_s=JOB_LOOKUP_TIMEOUT_S)
            except ApiError:  # unknown job (404), trainer down or slow: not a job we know
                job = None
            if job is not None:
                return (f"job {name} is not deployed yet ({job.status.value}, step {job.step} of "
                        f"{job.max_steps}): it is served once a replica has loaded a checkpoint of it")
        return f"The model `{name}` does not exist. Served models: {known}."
