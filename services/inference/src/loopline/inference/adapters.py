"""Run-time adapters of one replica: every job's newest checkpoint, loaded off the serving path.

The checkpoint-watcher announces each job's newest checkpoint on ``checkpoints.<base>.<hash>``
(the stream keeps the last one per subject). This replica follows those of its base model with an
ordered push consumer that starts with the last message of every subject (a replica started later
catches up) and then gets each new one as it is published. The loader loop (``run``, the
replica's ``adapter-loads`` loop) downloads the adapter
from the object store, unpacks it into a folder of this replica's own, loads it into the engine as
a new *version*, and only then points the job at it; the replica then announces
``events.adapters.<hash>.loaded``.

Requests pin the version current when they start (``acquire``) and let go when done (``release``);
a version that is no longer current is unloaded when its last request lets go. At most
``max_jobs`` jobs keep a version loaded: the least recently used one is unloaded (it stays known,
and its next request loads it again).

A full fine-tune's version is an engine of its own (full_weights.py), so those have a bound of
their own, ``max_full_engines``, taken before a load downloads anything or starts a child. A
request that finds every engine taken waits its turn (first come, first served): the least
recently used idle engine is stopped for it, or, when all are busy, the least recently used one
takes no new requests and stops once its last one ends, so one busy tenant cannot hold the engines
against the others. The wait is bounded (``full_engine_wait_s``, then a 503 naming the settings).
An engine that dies is noticed as it exits: its version is unloaded (the next request starts it
again), and the replica reports it as a ``rejected`` event, which the gateway shows as the job's
``deployment_error`` until a later load.

A deleted job is retired (``events.adapters.<hash>.retired``, adapter_retire.py): the replica
forgets it, unloads its version once no request pins it, and never loads a checkpoint of it written
before the retirement, however late its announce arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Histogram

from loopline.common.config.settings import InferenceSettings
from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import is_job_hash
from loopline.common.contracts.job_schemas import AdapterEvent, CheckpointAnnounce
from loopline.common.runtime import bus, metrics
from loopline.inference.adapter_files import BadArchive, download, unpack
from loopline.inference.vllm_server import AdapterRejected, VllmServer
from loopline.ml.adapters import read_adapter_config

log = logging.getLogger(__name__)

# Announce-driven loads that fail for a passing reason (NATS restarting) are retried this often.
LOAD_ATTEMPTS = 4

LOADS = Counter("loopline_adapter_loads", (
    "Adapter checkpoint loads on this replica, by outcome (loaded; rejected: the engine or the files "
    "refuse it; failed: a passing fault, retried) and adapter type."), ["outcome", "adapter_type"])
LOAD_LATENCY = Histogram("loopline_adapter_load_seconds", (
    "Loading one adapter checkpoint (download, unpack, into the engine), by adapter type."),
    ["adapter_type"], buckets=metrics.LATENCY_BUCKETS)


ENGINE_DEATHS = Counter("loopline_full_weight_engine_deaths", (
    "Full fine-tunes' own engines that exited by themselves while loaded on this replica (each "
    "unloaded; the next request starts it again)."))

FULL_WEIGHTS = "none"  # the adapter_type of a full fine-tune (docs/adapter-format.md)
_DEFAULTS = InferenceSettings.model_fields


@dataclass(eq=False)  # identity, not value: two loads of one step are two versions
class Version:
    job_hash: str
    step: int
    sha256: str
    handle: Any  # what the engine's load_adapter returned; requests generate with it
    folder: Path
    refs: int = 0
    full: bool = False  # a full fine-tune: it holds one of the engine slots until unloaded
    watch: asyncio.Task | None = None  # a full fine-tune's: waits for its engine to die
    unloaded: bool = False


class AdapterUnavailable(Exception):
    """A request named a job this replica cannot serve; ``status`` is the HTTP status to answer.
    ``retry``: a passing fault that another delivery may not meet (NATS restarting); otherwise
    the request is answered with it."""

    def __init__(self, status: int, message: str, *, retry: bool = True):
        super().__init__(message)
        self.status, self.message, self.retry = status, message, retry


class _Refused(Exception):
    """The checkpoint cannot be served by this replica, however often we try."""


class _NoEngineFree(Exception):
    """A full fine-tune announced, not asked for, with every engine taken: it loads when asked."""


class AdapterManager:
    def __init__(self, js: JetStreamContext, engine: VllmServer, *, base_model: str, replica: str,
                 root: Path, max_jobs: int,
                 max_full_engines: int = _DEFAULTS["max_full_weight_engines"].default,
                 full_engine_wait_s: float = _DEFAULTS["full_weights_queue_timeout_s"].default):
        self.js, self.engine = js, engine
        self.base_model, self.replica = base_model, replica
        self.root = root
        self.max_jobs = max_jobs
        self.max_full_engines = max_full_engines  # InferenceSettings.max_full_weight_engines
        self.full_engine_wait_s = full_engine_wait_s  # InferenceSettings.full_weights_queue_timeout_s
        # Engine slots held: full fine-tunes loaded (current or still pinned) or loading.
        self.full_engines = 0
        # Loads waiting for a slot, first come first served; set whenever a slot may have freed.
        self.engine_queue: deque[object] = deque()
        self._slots_changed = asyncio.Event()
        # job -> the version new requests get; ordered least recently used first.
        self.current: OrderedDict[str, Version] = OrderedDict()
        # job -> its newest checkpoint known to this replica, loaded or not.
        self.announces: dict[str, CheckpointAnnounce] = {}
        # job -> (step, sha256, why) of a newest checkpoint the engine refused.
        self.rejected: dict[str, tuple[int, str, str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._loads = 0
        self._tasks: set[asyncio.Task] = set()
        # job -> when it was retired (deleted): checkpoints written before then are not served.
        self.retired: dict[str, float] = {}
        self._sub: JetStreamContext.PushSubscription | None = None
        self._retire_sub: JetStreamContext.PushSubscription | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        # Folders of a previous run of this replica are stale: their versions died with it.
        await asyncio.to_thread(shutil.rmtree, self.root, True)
        self.root.mkdir(parents=True, exist_ok=True)
        # Retirements first: one published while the checkpoints catch up is not missed. Only new
        # ones: a job retired earlier has no announce left to catch up with.
        self._retire_sub = await self.js.subscribe(
            subjects.ADAPTER_RETIREMENTS, stream=subjects.EVENTS_STREAM, cb=self._on_retired,
            ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        self._sub = await self.js.subscribe(
            subjects.checkpoints_of_base(self.base_model), stream=subjects.CHECKPOINTS_STREAM,
            cb=self._on_announce, ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)

    async def stop(self) -> None:
        for sub in (self._sub, self._retire_sub):
            if sub is not None:
                await sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.to_thread(shutil.rmtree, self.root, True)

    def loaded(self) -> dict[str, int]:
        """job -> step of its current version (for the status endpoint)."""
        return {job: v.step for job, v in self.current.items()}

    # --- requests ---------------------------------------------------------------------------------
    async def acquire(self, job_hash: str) -> Version:
        """The job's current version, pinned until ``release``; loads it first if it is not loaded
        (a job evicted by the LRU bound, or announced before this replica caught up)."""
        version = self.current.get(job_hash)
        if version is not None:
            # No await between finding the version and pinning it: it cannot be unloaded between.
            version.refs += 1
            self.current.move_to_end(job_hash)
            return version
        # A job hash names a subject token and a folder: nothing else may pass.
        if not is_job_hash(job_hash):
            raise AdapterUnavailable(400, f"{job_hash!r} is not a job hash")
        if job_hash not in self.announces:
            await self._look_up(job_hash)
        return await self._ensure(job_hash, pin=True)

    async def release(self, version: Version) -> None:
        version.refs -= 1
        if version.refs == 0 and self.current.get(version.job_hash) is not version:
            await self._unload(version)
        if version.full and version.refs == 0:
            self._slots_changed.set()  # an idle engine: a queued load may stop it
        await self._evict()

    # --- announces --------------------------------------------------------------------------------
    async def _on_announce(self, msg) -> None:
        try:
            announce = CheckpointAnnounce.model_validate_json(msg.data)
        except ValueError:
            log.error("ignoring a malformed checkpoint announce on %s", msg.subject)
            return
        if not is_job_hash(announce.job_hash):
            log.error("ignoring a checkpoint announce for job %r", announce.job_hash)
            return
        if self._is_retired(announce):
            return
        self.announces[announce.job_hash] = announce
        # Catching up with more jobs than the LRU keeps: load only the newest max_jobs (the last
        # messages delivered); older ones stay known and load at their first request.
        if msg.metadata.num_pending >= self.max_jobs and announce.job_hash not in self.current:
            return
        if announce.job_hash not in self._queued:
            self._queued.add(announce.job_hash)
            self._queue.put_nowait(announce.job_hash)

    async def run(self, stopping: asyncio.Event) -> None:
        """The replica's ``adapter-loads`` loop: load each announced checkpoint, off the serving
        path, until ``stopping``. It is a named loop of the runtime, so a loader that dies ends the
        process: a replica that silently stopped loading would go on answering with old versions."""
        stopped = asyncio.ensure_future(stopping.wait())
        try:
            # Invariant: every job in the queue has an announce newer than its current version, or
            # had one when queued (_ensure then finds nothing to do). One load at a time: loads are
            # short, and one at a time keeps the engine's memory and the CPU for serving.
            while not stopping.is_set():
                queued = asyncio.ensure_future(self._queue.get())
                await asyncio.wait({queued, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not queued.done():
                    queued.cancel()
                    return
                await self._load_announced(queued.result())
        finally:
            stopped.cancel()

    async def _load_announced(self, job_hash: str) -> None:
        """Load ``job_hash``'s announced checkpoint, retrying what failed for a passing reason."""
        self._queued.discard(job_hash)
        for attempt in range(LOAD_ATTEMPTS):
            try:
                await self._ensure(job_hash)
                break
            except _NoEngineFree as exc:
                log.info("not preloading the full fine-tune %s: %s; it loads at its next request",
                         job_hash[:12], exc)
                break
            except AdapterUnavailable as exc:
                if exc.status != 503 or not exc.retry:
                    break  # rejected: the event said why; a newer checkpoint may do better
                log.warning("loading %s failed (%s); retrying", job_hash[:12], exc.message)
                await asyncio.sleep(0.5 * 2 ** attempt)
            except Exception:  # keep loading other jobs whatever happens
                log.exception("loading the adapter of %s failed", job_hash[:12])
                break

    async def _look_up(self, job_hash: str) -> None:
        subject = subjects.checkpoint_subject(self.base_model, job_hash)
        try:
            msg = await self.js.get_last_msg(subjects.CHECKPOINTS_STREAM, subject)
        except NotFoundError:
            raise AdapterUnavailable(404, f"job {job_hash} has no checkpoint for {self.base_model}") from None
        except Exception as exc:  # NATS restarting
            raise AdapterUnavailable(503, f"cannot look up the checkpoints of {job_hash}: {exc}") from exc
        announce = CheckpointAnnounce.model_validate_json(msg.data or b"")
        if self._is_retired(announce):
            raise AdapterUnavailable(404, f"job {job_hash} was deleted")
        self.announces.setdefault(job_hash, announce)

    # --- loading ----------------------------------------------------------------------------------
    async def _ensure(self, job_hash: str, *, pin: bool = False) -> Version:
        """Make the job's newest known checkpoint its current version (a no-op when it is); with
        ``pin``, the version returned is pinned for a request."""
        lock = self._locks.setdefault(job_hash, asyncio.Lock())
        async with lock:
            announce = self.announces.get(job_hash)
            if announce is None:  # retired while it waited for the lock
                raise AdapterUnavailable(404, f"job {job_hash} was deleted")
            current = self.current.get(job_hash)
            if current is not None and (current.step, current.sha256) == (announce.step, announce.sha256):
                current.refs += pin
                return current
            refused = self.rejected.get(job_hash)
            if refused is None or refused[:2] != (announce.step, announce.sha256):
                started = time.time()
                try:
                    version = await self._load(announce, queue=pin)
                except _Refused as exc:
                    self._reject(announce, str(exc))
                    refused = self.rejected[job_hash]
                else:
                    # Point and pin before any await: nothing can unload it in between. The
                    # previous version is read again: the LRU may have evicted it during the load.
                    previous = self.current.pop(job_hash, None)
                    self.current[job_hash] = version  # most recently used
                    version.refs += pin
                    self._loaded(announce, started)
                    if previous is not None and previous.refs == 0:
                        await self._unload(previous)  # else its last request unloads it
                    await self._evict()
                    return version
            current = self.current.get(job_hash)
            if current is not None:
                current.refs += pin
                return current  # the newest cannot be served; the one before still can
            raise AdapterUnavailable(422, f"job {job_hash} cannot be served here: {refused[2]}")

    async def _load(self, announce: CheckpointAnnounce, *, queue: bool) -> Version:
        """The announced checkpoint as a new version. A full fine-tune takes an engine slot first
        (``queue``: waiting its turn; else only a free one)."""
        full = announce.adapter_type == FULL_WEIGHTS
        if full:
            await self._take_engine_slot(announce.job_hash, queue=queue)
        try:
            version = await self._fetch_and_load(announce, full)
        except BaseException:
            if full:
                self._give_back_engine_slot()
            raise
        if full:
            version.watch = self._spawn(self._watch_engine(version))
        return version

    async def _fetch_and_load(self, announce: CheckpointAnnounce, full: bool) -> Version:
        self._loads += 1
        # A folder per load: a version being reloaded never shares files with one being unloaded.
        folder = self.root / announce.job_hash / f"{announce.step}-{self._loads}"
        try:
            archive = await download(self.js, announce, folder)
            checkpoint = await asyncio.to_thread(unpack, archive, folder)
            archive.unlink()
            config = await asyncio.to_thread(read_adapter_config, checkpoint)
            # The slot was taken (or not) on the announce's word: the files must agree with it.
            if (config.get("adapter_type") == FULL_WEIGHTS) != full:
                raise AdapterRejected(f"the checkpoint's adapter_type {config.get('adapter_type')!r} "
                                      f"is not its announce's {announce.adapter_type!r}")
            handle = await self.engine.load_adapter(f"{announce.job_hash}@{announce.step}",
                                                    checkpoint, config)
        except (AdapterRejected, BadArchive, ValueError) as exc:
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise _Refused(str(exc)) from exc
        except Exception as exc:  # the object store is unreachable: may pass
            LOADS.labels("failed", announce.adapter_type).inc()
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise AdapterUnavailable(503, f"could not fetch {announce.object_name}: {exc!r}") from exc
        return Version(announce.job_hash, announce.step, announce.sha256, handle, folder, full=full)

    # --- full fine-tunes' engines -----------------------------------------------------------------
    async def _take_engine_slot(self, job_hash: str, *, queue: bool) -> None:
        """Hold one of the ``max_full_engines`` slots. Without ``queue`` (a load no request waits
        for) only a slot free now, or one the job's own loaded version holds, is taken, else
        _NoEngineFree. With it, wait in line: the head stops the least recently used idle engine,
        or drains a busy one, until a slot is free; AdapterUnavailable (503) after the wait."""
        if not queue and self.full_engines >= self.max_full_engines and not (
                (own := self.current.get(job_hash)) is not None and own.full):
            raise _NoEngineFree(f"all {self.max_full_engines} engines are taken "
                                "(LOOPLINE_MAX_FULL_WEIGHT_ENGINES)")
        ticket = object()
        self.engine_queue.append(ticket)
        deadline = time.monotonic() + self.full_engine_wait_s
        try:
            # Invariant: full_engines counts every slot held; only the queue's head takes one.
            while True:
                if self.engine_queue[0] is ticket:
                    if self.full_engines < self.max_full_engines:
                        self.full_engines += 1
                        return
                    if await self._free_an_engine(job_hash):
                        continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AdapterUnavailable(503, self._engines_busy(), retry=False)
                self._slots_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slots_changed.wait(), left)
        finally:
            self.engine_queue.remove(ticket)
            self._slots_changed.set()  # the next in line looks again

    async def _free_an_engine(self, job_hash: str) -> bool:
        """Stop the least recently used idle full fine-tune (True); when every one is busy, take
        the least recently used out of ``current`` instead, so that no new request pins it and its
        last request unloads it (release), and return False: the slot frees later."""
        loaded = [(job, v) for job, v in self.current.items() if v.full]
        idle = next(((job, v) for job, v in loaded if v.refs == 0), None)
        if idle is not None:
            log.info("stopping the idle full fine-tune %s for %s", idle[0][:12], job_hash[:12])
            await self._unload(self.current.pop(idle[0]))
            return True
        if loaded:
            busy_job, busy = loaded[0]
            log.info("draining the full fine-tune %s (%d requests) for %s", busy_job[:12], busy.refs,
                     job_hash[:12])
            del self.current[busy_job]
        return False

    def _give_back_engine_slot(self) -> None:
        self.full_engines -= 1
        self._slots_changed.set()

    def _engines_busy(self) -> str:
        return (f"all {self.max_full_engines} full fine-tune engines of this replica stayed busy for "
                f"{self.full_engine_wait_s:g} s (LOOPLINE_MAX_FULL_WEIGHT_ENGINES, "
                "LOOPLINE_FULL_WEIGHTS_QUEUE_TIMEOUT_S): retry later")

    async def _watch_engine(self, version: Version) -> None:
        """Wait for the version's engine to die; then unload it (now, or at its last request's
        release) and report it. Cancelled when the version is unloaded."""
        why = await version.handle.exited()
        if version.handle.stopping:
            return  # stopped by us (unloaded, the replica stopping): no death
        ENGINE_DEATHS.inc()
        log.error("%s step %d: %s; unloaded, the next request starts it again", version.job_hash[:12],
                  version.step, why)
        version.watch = None  # this task is ending: _unload must not cancel it
        if self.current.get(version.job_hash) is version:
            del self.current[version.job_hash]
        if version.refs == 0:
            await self._unload(version)
        self._emit(AdapterEvent(job_hash=version.job_hash, kind="rejected", step=version.step,
                                reason=f"{why} on replica {self.replica}; it restarts at the next request",
                                replica=self.replica, base_model=self.base_model,
                                adapter_type=FULL_WEIGHTS))

    def _loaded(self, announce: CheckpointAnnounce, started: float) -> None:
        loaded = time.time()
        LOADS.labels("loaded", announce.adapter_type).inc()
        LOAD_LATENCY.labels(announce.adapter_type).observe(loaded - started)
        log.info("serving %s step %d: loaded in %.3f s, %.3f s after it was written",
                 announce.job_hash[:12], announce.step, loaded - started, loaded - announce.created_at)
        self._emit(AdapterEvent(
            job_hash=announce.job_hash, kind="loaded", step=announce.step, time=loaded,
            replica=self.replica, base_model=self.base_model, adapter_type=announce.adapter_type,
            latency_s=loaded - announce.created_at, load_s=loaded - started,
            checkpoint_created_at=announce.created_at))

    def _reject(self, announce: CheckpointAnnounce, why: str) -> None:
        log.warning("cannot serve %s step %d: %s", announce.job_hash[:12], announce.step, why)
        self.rejected[announce.job_hash] = (announce.step, announce.sha256, why)
        LOADS.labels("rejected", announce.adapter_type).inc()
        self._emit(AdapterEvent(job_hash=announce.job_hash, kind="rejected", step=announce.step,
                                reason=why, replica=self.replica, base_model=self.base_model,
                                adapter_type=announce.adapter_type))

    async def _evict(self) -> None:
        """Unload least recently used jobs, skipping versions in use and the job used last (just
        loaded for a request about to pin it), until within the bound."""
        while len(self.current) > self.max_jobs:
            candidates = list(self.current.items())[:-1]
            idle = next((job for job, v in candidates if v.refs == 0), None)
            if idle is None:
                return  # all busy: the next release evicts
            await self._unload(self.current.pop(idle))

    async def _unload(self, version: Version) -> None:
        if version.unloaded:  # a dead engine's version may be let go by two paths
            return
        version.unloaded = True
        if version.watch is not None:
            version.watch.cancel()
        try:
            await self.engine.unload_adapter(version.handle)
        except Exception:  # the engine is stopping; nothing left to free
            log.exception("unloading %s step %d failed", version.job_hash[:12], version.step)
        finally:
            if version.full:  # its engine is stopped: the slot is free
                self._give_back_engine_slot()
        await asyncio.to_thread(shutil.rmtree, version.folder, True)
        log.info("unloaded %s step %d", version.job_hash[:12], version.step)

    # --- retirement -------------------------------------------------------------------------------
    def _is_retired(self, announce: CheckpointAnnounce) -> bool:
        return announce.created_at <= self.retired.get(announce.job_hash, float("-inf"))

    async def _on_retired(self, msg) -> None:
        try:
            event = AdapterEvent.model_validate_json(msg.data)
        except ValueError:
            log.error("ignoring a malformed retirement on %s", msg.subject)
            return
        self.retired[event.job_hash] = max(event.time, self.retired.get(event.job_hash, event.time))
        self._spawn(self.retire(event.job_hash))

    async def retire(self, job_hash: str) -> None:
        """Forget a deleted job; its version goes now, or when its last request lets go (release).
        Under the job's lock: a load in progress finishes first, then is unloaded here."""
        async with self._locks.setdefault(job_hash, asyncio.Lock()):
            self.announces.pop(job_hash, None)
            self.rejected.pop(job_hash, None)
            version = self.current.pop(job_hash, None)
            if version is not None and version.refs == 0:
                await self._unload(version)
        log.info("job %s retired%s", job_hash[:12], "" if version is None else
                 f"; step {version.step} {'unloaded' if version.refs == 0 else 'unloads when unpinned'}")

    # --- events -----------------------------------------------------------------------------------
    def _emit(self, event: AdapterEvent) -> None:
        """Publish in the background: a slow or restarting NATS must not hold up serving."""
        msg_id = f"{event.job_hash}:{event.step}:{self.replica}:{event.kind}:{self._loads}"
        self._spawn(bus.publish_durable(self.js, subjects.adapter_event(event.job_hash, event.kind),
                                        event.model_dump_json().encode(), msg_id=msg_id))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
