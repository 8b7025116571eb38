"""The gateway's side of NATS: model registry, admission, publishing work, collecting results.

The gateway owns nothing persistent. A request is accepted once JetStream has acked its work items;
from then on its answer lives in RESULTS, where any gateway can find it by subject.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError

from loopline.common import bus, subjects
from loopline.common.job_schemas import JobInfo, JobRef
from loopline.common.schemas import BatchManifest, DeploymentInfo, QueueState, ResultItem, WorkItem
from loopline.common.settings import GatewaySettings
from loopline.gateway.adapters import AdapterRegistry
from loopline.gateway.answers import Answers
from loopline.gateway.errors import ApiError

log = logging.getLogger(__name__)

# How often the model registry is re-read; a miss also re-reads it at once.
MODELS_REFRESH_S = 2.0
# A queue state older than this is ignored (the queue service is down): admit, JetStream still
# bounds the stream.
QUEUE_STATE_STALE_S = 5.0
# While waiting, results we may have missed (a NATS reconnect drops core messages) are looked up.
RECHECK_S = 1.0
# What the trainer names jobs by; such a name that is no served model may be a job not deployed yet.
_JOB_HASH = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Route:
    """Where a request's ``model`` goes: a deployment, and on it the base model or a job's adapter."""

    info: DeploymentInfo
    model: str  # the name the client used (a job hash for an adapter; ``latest`` resolved)
    adapter: str | None = None  # the job hash whose newest adapter generates
    step: int | None = None  # the adapter's newest step some replica loaded

    @property
    def deployment(self) -> str:
        return self.info.deployment

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len


class Bridge:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.nc: NATS | None = None
        self.models: dict[str, DeploymentInfo] = {}
        self.queue_state: QueueState | None = None
        self._admitted_since_state: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await bus.connect(self.settings.nats_url, "gateway")
        self.js = self.nc.jetstream()
        await bus.ensure_topology(self.js)
        self.models_kv = await self.js.key_value(subjects.MODELS_BUCKET)
        self.batches_kv = await self.js.key_value(subjects.BATCHES_BUCKET)
        await self.nc.subscribe(subjects.QUEUE_STATE, cb=self._on_queue_state)
        self.answers = Answers(self.nc)
        await self.answers.start()
        await self.refresh_models()
        self._tasks.append(asyncio.create_task(self._refresh_models_forever()))
        self.adapters = AdapterRegistry(self.js)
        await self.adapters.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if getattr(self, "adapters", None) is not None:
            await self.adapters.stop()
        if self.nc is not None:
            await self.nc.drain()

    # --- models -----------------------------------------------------------------------------------
    async def refresh_models(self) -> None:
        """Re-read the served models. A read that fails for another reason than "nothing there"
        (NATS busy or reconnecting) keeps what we knew: under load a timed-out ``keys()`` used to
        empty the registry, and requests for a served model got 404 until the next refresh."""
        try:
            keys = await self.models_kv.keys()
        except NoKeysError:
            keys = []
        except Exception as exc:  # noqa: BLE001 - keep the last known registry
            log.debug("model refresh failed: %s", exc)
            return
        known = {info.deployment: info for info in self.models.values()}
        models = {}
        for key in keys:
            try:
                info = DeploymentInfo.model_validate_json((await self.models_kv.get(key)).value)
            except KeyNotFoundError:  # deleted between keys() and get()
                continue
            except Exception as exc:  # noqa: BLE001 - unreadable now: keep what we had for it
                log.debug("reading model %s failed: %s", key, exc)
                info = known.get(key)
                if info is None:
                    continue
            models[info.model] = info
        self.models = models

    async def _refresh_models_forever(self) -> None:
        while True:
            await asyncio.sleep(MODELS_REFRESH_S)
            try:
                await self.refresh_models()
            except Exception as exc:  # noqa: BLE001 - NATS down: keep the last known registry
                log.debug("model refresh failed: %s", exc)

    async def resolve(self, name: str | None) -> Route:
        """Where ``model`` goes: a served model by name (``None``: the default model), a job hash
        (its newest loaded adapter on the job's base model) or ``latest`` (the job loaded last)."""
        name = name or self.settings.model
        # A deployed job hash is not a model name: no need to re-read the models for it.
        if name not in self.models and not self.adapters.deployed(name):
            await self.refresh_models()
        if name in self.models:
            return Route(self.models[name], name)
        if name == self.settings.model and len(self.models) == 1:
            return Route(next(iter(self.models.values())), name)
        if name == "latest":
            served = self.adapters.latest(set(self.models))
        else:
            served = await self.adapters.find(name)
        if served is not None and served.base_model in self.models:
            return Route(self.models[served.base_model], served.job_hash, served.job_hash, served.step)
        raise ApiError(404, await self._not_served(name, served), param="model", type="model_not_found")

    async def _not_served(self, name: str, served) -> str:
        """Why ``name`` is not servable, as precisely as we can tell (this is the error path)."""
        if served is not None:
            return f"job {name} adapts {served.base_model!r}, which no inference replica serves now"
        if name == "latest":
            return "no training job has a deployed adapter yet"
        known = ", ".join(sorted(self.models)) or "none yet"
        if name in self.adapters.rejected:
            return f"job {name} is not deployed: {self.adapters.rejected[name]}"
        if _JOB_HASH.match(name):
            job = await self._job(name)
            if job is not None:
                return (f"job {name} is not deployed yet ({job.status.value}, step {job.step} of "
                        f"{job.max_steps}): it is served once a replica has loaded a checkpoint of it")
        return f"model {name!r} not found; served models: {known}"

    async def _job(self, job_hash: str) -> JobInfo | None:
        try:
            ref = JobRef(job=job_hash).model_dump_json().encode()
            msg = await self.nc.request(subjects.SVC_TRAINER_GET, ref, timeout=2.0)
            return JobInfo.model_validate_json(msg.data)
        except Exception:  # noqa: BLE001 - unknown job (an error reply), trainer down: not a job we know
            return None

    # --- admission --------------------------------------------------------------------------------
    async def _on_queue_state(self, msg: Msg) -> None:
        self.queue_state = QueueState.model_validate_json(msg.data)
        self._admitted_since_state.clear()

    def admit(self, deployment: str, count: int) -> None:
        state = self.queue_state
        if state is None or time.time() - state.at > QUEUE_STATE_STALE_S:
            return
        load = state.deployments.get(deployment)
        depth = (load.depth if load else 0) + self._admitted_since_state.get(deployment, 0)
        if depth + count > state.max_depth:
            raise ApiError(
                429,
                f"the queue for this model is full ({depth} requests waiting or running, limit "
                f"{state.max_depth}); retry after {self.settings_retry_after()} s",
                headers={"Retry-After": str(self.settings_retry_after())},
            )
        self._admitted_since_state[deployment] = self._admitted_since_state.get(deployment, 0) + count

    def settings_retry_after(self) -> int:
        return self.settings.retry_after_s

    # --- submitting -------------------------------------------------------------------------------
    async def manifest(self, group: str) -> BatchManifest | None:
        try:
            entry = await self.batches_kv.get(group)
        except Exception:  # noqa: BLE001 - KeyNotFoundError and friends
            return None
        return BatchManifest.model_validate_json(entry.value) if entry.value else None

    async def submit(self, manifest: BatchManifest | None, items: list[WorkItem], deployment: str) -> None:
        """Make the batch durable: every item, each awaited until acked, then the manifest — a batch
        is "known" (and a resubmission skipped) only once all of its work is stored."""
        def publish(item: WorkItem):
            return bus.publish_durable(self.js, subjects.work(deployment), item.model_dump_json().encode(),
                                       msg_id=item.request_id, deadline_s=30)

        try:
            if len(items) == 1:
                # The common case (one chat or completion) skips gather's task: one event-loop turn
                # less before the work item is on its way.
                await publish(items[0])
            else:
                await asyncio.gather(*(publish(item) for item in items))
            if manifest is not None:
                await self.batches_kv.put(manifest.group, manifest.model_dump_json().encode())
        except bus.StreamFull as exc:
            raise ApiError(429, f"the work queue is full: {exc}; retry later",
                           headers={"Retry-After": str(self.settings_retry_after())}) from exc
        except bus.BusUnavailable as exc:
            raise ApiError(503, f"the message bus did not accept the request: {exc}; retry",
                           headers={"Retry-After": "1"}) from exc

    # --- results ----------------------------------------------------------------------------------
    async def results(self, group: str) -> "ResultWaiter":
        waiter = ResultWaiter(self, group)
        await waiter.open()
        return waiter

    async def lookup(self, group: str, index: int) -> ResultItem | None:
        try:
            raw = await self.js.get_last_msg(subjects.RESULTS_STREAM, subjects.result(group, index),
                                             direct=True)
        except NotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - NATS restarting: the caller asks again later
            log.debug("lookup of %s.%d failed: %s", group, index, exc)
            return None
        return ResultItem.model_validate_json(raw.data)

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 5.0) -> bytes:
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - no responders, timeout, NATS down
            raise ApiError(503, f"{subject} did not answer ({type(exc).__name__}); is the service running?") from exc
        return msg.data

    async def ping(self, service: str, wait_s: float = 0.25) -> list[dict]:
        """Every running instance of a nats.micro service, from ``$SRV.PING.<name>``."""
        import json

        inbox = self.nc.new_inbox()
        replies: list[dict] = []

        async def collect(msg: Msg) -> None:
            if msg.data:  # an empty one is NATS's "no responders" status: none is running
                replies.append(json.loads(msg.data))

        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
            await asyncio.sleep(wait_s)
        finally:
            await sub.unsubscribe()
        return replies


class ResultWaiter:
    """Collects a group's results: those already stored and those that arrive while we wait."""

    def __init__(self, bridge: Bridge, group: str):
        self.bridge = bridge
        self.group = group
        self.found: dict[int, ResultItem] = {}
        self._arrived = asyncio.Event()
        self._sub = None

    async def open(self) -> None:
        self._sub = await self.bridge.nc.subscribe(subjects.results_of_group(self.group), cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        result = ResultItem.model_validate_json(msg.data)
        self.found.setdefault(result.index, result)
        self._arrived.set()

    async def fill_from_store(self, indices: Iterable[int]) -> None:
        missing = [i for i in indices if i not in self.found]
        found = await asyncio.gather(*(self.bridge.lookup(self.group, i) for i in missing))
        for i, result in zip(missing, found):
            if result is not None:
                self.found.setdefault(i, result)

    async def wait(self, indices: list[int], timeout_s: float, *, stored_first: bool) -> dict[int, ResultItem]:
        """Return the results of ``indices`` available within ``timeout_s``."""
        wanted = set(indices)
        if stored_first:
            await self.fill_from_store(wanted)
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + RECHECK_S
        # Invariant: self.found holds every result seen so far; we return as soon as it covers
        # every wanted index, or when the deadline passes.
        while not wanted.issubset(self.found):
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_check:
                await self.fill_from_store(wanted)
                next_check = now + RECHECK_S
                continue
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=min(deadline, next_check) - now)
            except asyncio.TimeoutError:
                pass
        return {i: self.found[i] for i in wanted if i in self.found}

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
