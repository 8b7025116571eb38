"""The session worker process: one base model resident, many Tinker training clients on it.

The trainer starts it as a Slurm job (a local process under the local launcher) with its settings
in the environment (``TinkerWorkerSettings``). It reads its calls from ``tinker.calls.<worker>``
(a durable pull consumer, so a call published while it loads waits for it) and runs each model's
calls in the order the SDK numbered them (``seq_id``), whatever order their HTTP requests reached
the gateway in: forward_backward chunks sent in parallel accumulate in the same order every run.

Loops, under the shared runtime:
  calls      fetch, order by (model, seq_id), run, store the result, ack; release idle clients
  heartbeat  the worker's record: alive, which models it holds; each model's last request time
A model's record is read once, at its first call here (what a call needs of it does not change),
and written when it changes: released, or a last request time newer than the one recorded (at
most once a heartbeat, not after every call).
A worker whose clients have all been released exits 0: the trainer then marks it released.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from loopline.common.config.settings import TinkerWorkerSettings
from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_schemas import FutureResult, SessionEvent, StepCall, TinkerModel
from loopline.common.runtime import bus
from loopline.common.runtime.service import Runtime, pause
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.tinker_worker.calls import Calls
from loopline.tinker_worker.training import TrainingClients

log = logging.getLogger(__name__)

# Calls of one model wait for their turn un-acked; a forward_backward on a large batch may take
# minutes. JetStream must not hand them out again meanwhile (nobody else reads this subject).
ACK_WAIT_S = 6 * 3600
FETCH_BATCH = 64
# After a failed fetch (NATS restarting, the consumer gone): a busy loop of retries cost half a
# core in the worker and half in nats-server (seen in bench/tinker.py).
FETCH_RETRY_S = 0.5
# How long a KV read or write in the calls loop is retried before the worker gives up (and exits).
PATIENCE_S = 120.0
T = TypeVar("T")


async def patiently(read: Callable[[], Awaitable[T]], what: str) -> T:
    """``read()``, tried again while NATS does not answer (a busy or restarting server), for up to
    PATIENCE_S: a KV timeout must not end the process, which would lose every client's state."""
    deadline = time.monotonic() + PATIENCE_S
    delay = 0.1
    while True:
        try:
            return await read()
        except (TimeoutError, nats.errors.Error) as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("%s failed (%s: %s); trying again", what, type(exc).__name__, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


@dataclass
class ModelQueue:
    """One model's calls that arrived before their turn."""

    next_seq: int = 1  # the SDK numbers a client's calls 1, 2, ... after its creating call
    waiting: dict[int, tuple[StepCall, Msg]] = field(default_factory=dict)
    stalled_since: float | None = None  # when a later call began waiting for a missing one
    last_used: float = field(default_factory=time.monotonic)
    model: TinkerModel | None = None  # its record, once read and found to be on this worker
    last_request_at: float = 0.0  # wall time its last call finished (the record's is older or equal)


class SessionWorker:
    def __init__(self, rt: Runtime, settings: TinkerWorkerSettings, calls: Calls, store: TinkerStore):
        self.rt = rt
        self.settings = settings
        self.calls = calls
        self.store = store
        self.queues: dict[str, ModelQueue] = {}
        self.idle_since = time.monotonic()
        self._tasks: set[asyncio.Task] = set()

    @functools.cached_property
    def shared_passes(self) -> bool:
        shared = self.settings.tinker_shared_passes
        return self.calls.clients.base.device.type != "cpu" if shared is None else shared

    async def calls_loop(self, stopping: asyncio.Event) -> None:
        js = self.rt.js
        assert js is not None
        sub = await js.pull_subscribe(
            subjects.tinker_calls(self.settings.tinker_worker_id),
            durable=subjects.tinker_calls_durable(self.settings.tinker_worker_id),
            stream=subjects.TINKER_CALLS_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                                  ack_wait=ACK_WAIT_S, max_ack_pending=100_000))
        # Invariant: a call is acked only once its result is stored; of each model's calls, those
        # numbered below its next_seq have run, in order, and none numbered above has.
        while not stopping.is_set():
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=1.0)
            except TimeoutError:
                msgs = []
            except Exception as exc:  # noqa: BLE001 - NATS reconnecting: fetch again, in a while
                log.warning("fetching calls failed: %s; trying again", exc)
                msgs = []
                if await pause(stopping, FETCH_RETRY_S):
                    return
            for msg in msgs:
                await self._arrived(msg)
            await self._run_ready()
            if await self._release_idle():
                stopping.set()  # every client is gone: end the process (exit 0)
                return

    async def _arrived(self, msg: Msg) -> None:
        call = StepCall.model_validate_json(msg.data)
        queue = self.queues.setdefault(call.model_id, ModelQueue())
        if call.seq_id is None:  # a model's first call (create, or load from state): its turn now
            await self._run(call, msg)
            queue.next_seq = 1
        elif call.seq_id < queue.next_seq:
            await msg.ack()  # a redelivery of a call that has run: its result is stored already
        else:
            queue.waiting[call.seq_id] = (call, msg)

    async def _run_ready(self) -> None:
        # Rounds: each takes every model's next call in its order; with shared passes on, the
        # round's forward_backward calls of different clients run in shared passes
        # (Calls.forward_backwards), the rest one by one (TinkerWorkerSettings says when it pays).
        while True:
            ready = [item for model_id, queue in list(self.queues.items())
                     if (item := self._next_ready(model_id, queue)) is not None]
            if not ready:
                return
            shared = [(call, msg) for call, msg in ready
                      if call.kind == "forward_backward" and self.shared_passes]
            if len(shared) < 2:
                shared = []
            else:
                await self._run_passes(shared)
            for call, msg in ready:
                if not any(call is other for other, _ in shared):
                    await self._run(call, msg)

    def _next_ready(self, model_id: str, queue: ModelQueue) -> tuple[StepCall, Msg] | None:
        """The model's next call, if it has arrived (taken off the queue)."""
        if not queue.waiting:
            return None
        if queue.next_seq not in queue.waiting:
            # The SDK numbers without gaps, but a call can be lost client-side (its process died
            # mid-send): after a while the later ones run without it.
            now = time.monotonic()
            queue.stalled_since = queue.stalled_since or now
            if now - queue.stalled_since < self.settings.tinker_gap_timeout_s:
                return None
            skipped_to = min(queue.waiting)
            log.warning("model %s: call %d never came; running %d", model_id, queue.next_seq, skipped_to)
            queue.next_seq = skipped_to
        queue.stalled_since = None
        item = queue.waiting.pop(queue.next_seq)
        queue.next_seq += 1
        return item

    async def _model_of(self, call: StepCall, msg: Msg) -> TinkerModel | None:
        """The call's model record (read at its first call here), or None when the call was not
        this worker's (it is then acked and dropped)."""
        queue = self.queues.setdefault(call.model_id, ModelQueue())
        queue.last_used = self.idle_since = time.monotonic()
        if queue.model is None:
            model = await patiently(lambda: self.store.model(call.model_id), "reading the model record")
            if model is None or model.worker_id != self.settings.tinker_worker_id:
                log.error("dropping %s for %s: no such model on this worker", call.kind, call.model_id)
                await msg.ack()
                return None
            queue.model = model
        return queue.model

    async def _run(self, call: StepCall, msg: Msg) -> None:
        model = await self._model_of(call, msg)
        if model is None:
            return
        result = await self.calls.run(call, model)
        self.queues[call.model_id].last_request_at = time.time()
        if result is None:  # finished in the background; acked there
            self._spawn_ack_later(call, msg)
            return
        await self._finished(call, msg, result)

    async def _run_passes(self, items: list[tuple[StepCall, Msg]]) -> None:
        """forward_backward calls of several models, in shared passes."""
        mine = [(call, msg, model) for call, msg in items
                if (model := await self._model_of(call, msg)) is not None]
        log.info("forward_backward of %d models in shared passes", len(mine))
        results = await self.calls.forward_backwards([(call, model) for call, _, model in mine])
        for (call, msg, _), result in zip(mine, results, strict=True):
            self.queues[call.model_id].last_request_at = time.time()
            await self._finished(call, msg, result)

    async def _finished(self, call: StepCall, msg: Msg, result: FutureResult) -> None:
        await self.store.finish(result)  # retried through NATS outages (publish_durable)
        await msg.ack()

    def _spawn_ack_later(self, call: StepCall, msg: Msg) -> None:
        finish = self.calls.pending.pop(call.request_id)

        async def finish_then_ack() -> None:
            await finish
            await msg.ack()

        task = asyncio.create_task(finish_then_ack())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release_idle(self) -> bool:
        """Release clients idle past the TTL; True when the worker has none left and should end."""
        ttl = self.settings.tinker_idle_ttl_s
        now = time.monotonic()
        for model_id, queue in list(self.queues.items()):
            if queue.waiting or now - queue.last_used < ttl:
                continue
            del self.queues[model_id]
            self.calls.release(model_id)
            model = await self.store.model(model_id)
            if model is not None and model.state == "active":
                model.state, model.error = "released", f"idle for more than {ttl:.0f} s"
                await self.store.put_model(model)
            self.emit(SessionEvent(worker_id=self.settings.tinker_worker_id, kind="released",
                                   model_id=model_id, detail=f"idle for {ttl:.0f} s"))
            log.info("released %s: idle for %.0f s", model_id, ttl)
        return not self.queues and not self._tasks and now - self.idle_since >= ttl

    # --- heartbeat and events ---------------------------------------------------------------------
    async def heartbeat_loop(self, stopping: asyncio.Event) -> None:
        # Invariant: the worker's record says it is ready, with the models it holds, and each active
        # model's record holds its last request time, as of the last beat NATS answered (at most
        # heartbeat_s ago while it answers).
        while True:
            try:
                await self._beat()
            except (TimeoutError, nats.errors.Error) as exc:  # nats' TimeoutError subclasses it
                # A busy or reconnecting NATS missed one beat: the next one records it. Letting the
                # loop die would end the process and lose every client's training state (it did, on
                # a machine swapping at load 100, 12 iterations into a cookbook RL run).
                log.warning("heartbeat not recorded (%s: %s); trying again in %.1f s",
                            type(exc).__name__, exc, self.settings.heartbeat_s)
            if await pause(stopping, self.settings.heartbeat_s):
                return

    async def _beat(self) -> None:
        worker = await self.store.worker(self.settings.tinker_worker_id)
        if worker is None or worker.state not in ("starting", "ready"):
            return  # the trainer has ended this worker: its records are the trainer's now
        worker.state, worker.heartbeat_at = "ready", time.time()
        worker.models = sorted(self.queues)
        await self.store.put_worker(worker)
        for queue in list(self.queues.values()):
            if queue.model is not None and queue.last_request_at > queue.model.last_request_at:
                await self._record_last_request(queue)

    async def _record_last_request(self, queue: ModelQueue) -> None:
        assert queue.model is not None
        # Read again before writing: the trainer may have failed the model meanwhile, and a copy
        # from its first call must not undo that.
        model = await self.store.model(queue.model.model_id)
        if model is None or model.state != "active" or model.worker_id != self.settings.tinker_worker_id:
            return
        model.last_request_at = queue.last_request_at
        await self.store.put_model(model)
        queue.model = model

    def emit(self, event: SessionEvent) -> None:
        js = self.rt.js
        assert js is not None
        msg_id = f"{event.worker_id}:{event.kind}:{event.model_id}:{event.step}:{event.path}:{event.time}"
        task = asyncio.create_task(bus.publish_durable(
            js, subjects.session_event(event.worker_id, event.kind), event.model_dump_json().encode(),
            msg_id=msg_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def run(rt: Runtime, settings: TinkerWorkerSettings) -> None:
    # 1. Load the base model once (a signal meanwhile cancels the start: the runtime).
    log.info("session worker %s: loading %s from %s", settings.tinker_worker_id, settings.tinker_base_model,
             settings.tinker_model_path)
    clients = await asyncio.to_thread(TrainingClients, settings.tinker_model_path,
                                      max_clients=settings.tinker_max_clients)

    # 2. Connect; the shared records.
    nc, js = await rt.connect()
    store = TinkerStore(js, nc.max_payload)
    await store.start()

    # 3. The calls and the loop that orders them.
    worker: SessionWorker
    calls = Calls(settings, clients, store, nc, js, emit=lambda event: worker.emit(event))
    worker = SessionWorker(rt, settings, calls, store)
    log.info("session worker %s ready: %s", settings.tinker_worker_id, settings.tinker_base_model)

    # 4. Serve until every client is released, or told to stop.
    await rt.serve({"calls": worker.calls_loop(rt.stopping), "heartbeat": worker.heartbeat_loop(rt.stopping)})

