"""The replica's loop: pull work sized to free engine capacity, serve it, publish, then ack.

A message is acked only after its result is durable in RESULTS, so a replica killed at any point
loses nothing: JetStream redelivers what it had not acked to another replica. Results carry the
request id as ``Nats-Msg-Id``, so a request answered twice is stored once. Told to stop, the loop
pulls nothing more and gives the requests in flight ``drain_s`` to finish before it returns.

When vLLM's engine dies (``VllmServer.dead``) no request is answered with the error its death caused:
``abandon`` cancels every request still being served and naks it, so another replica takes it at
once, and whatever is pulled afterwards is nak'd untouched. A request whose answer is already being
published finishes publishing (it succeeded; cancelling it could answer it twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ErrorInfo, ResultItem, WorkItem, stream_event
from loopline.common.runtime import bus
from loopline.common.runtime.telemetry import context_from_headers, tracer
from loopline.inference.adapters import AdapterManager, AdapterUnavailable, Version
from loopline.inference.full_weights import FullWeightsModel
from loopline.inference.vllm_answers import VersionStamp, error_of, usage_of, with_model
from loopline.inference.vllm_server import EngineDead, VllmServer

log = logging.getLogger(__name__)
_tracer = tracer("loopline.inference")
# After the stop, requests in flight get this long to finish: the generations of a burst on a
# small CPU replica take seconds. Less than the runtime's grace (runtime.GRACE_S, 10 s), so the
# loop returns by itself rather than being cancelled; what is unfinished then is redelivered.
DRAIN_S = 9.0


class Worker:
    def __init__(self, nc: NATS, js: JetStreamContext, server: VllmServer, *,
                 deployment: str, replica: str, max_inflight: int, ack_wait_s: float, max_deliver: int,
                 adapters: AdapterManager | None = None):
        self.nc, self.js, self.server = nc, js, server
        self.adapters = adapters
        self.deployment, self.replica = deployment, replica
        self.max_inflight = max_inflight
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self.inflight: dict[str, Msg] = {}
        # The requests of self.inflight still being served (not yet publishing their answer): what
        # abandon() may cancel.
        self.serving: dict[str, asyncio.Task] = {}
        # request id -> set when its client went away (subjects.cancel), for the requests being served.
        self.gone: dict[str, asyncio.Event] = {}
        self.capacity_freed = asyncio.Event()
        self.served = 0

    async def run(self, stopping: asyncio.Event, *, drain_s: float = DRAIN_S) -> None:
        """Serve until ``stopping`` is set, then give the requests in flight ``drain_s`` (counted
        from the stop) to finish, and return."""
        psub = await self.js.pull_subscribe_bind(
            subjects.inference_durable(self.deployment), stream=subjects.WORK_STREAM
        )
        keepalive = asyncio.create_task(self._keep_inflight_alive())
        cancels = await self.nc.subscribe(subjects.CANCELS, cb=self._on_cancel)
        stopped_at = asyncio.get_running_loop().create_future()
        waking = asyncio.create_task(self._wake_on(stopping, stopped_at))
        try:
            # Invariant: len(self.inflight) <= self.max_inflight, and every message we hold is
            # either in self.inflight (being generated) or already acked. Nothing is pulled once
            # ``stopping`` is set (a pull in progress still starts what it brings, at most 2 s).
            while not stopping.is_set():
                if self.server.dead:
                    # Pull nothing more: a request pulled now would only be nak'd, and each lap
                    # would spend one of its deliveries. The engine watch stops the process.
                    await stopping.wait()
                    break
                free = self.max_inflight - len(self.inflight)
                if free <= 0:
                    self.capacity_freed.clear()
                    await self.capacity_freed.wait()
                    continue
                await self._pull(psub, free)
            await self._drain(deadline=await stopped_at + drain_s)
        finally:
            waking.cancel()
            keepalive.cancel()
            with contextlib.suppress(Exception):
                await cancels.unsubscribe()
            # What is still queued for this subscription would otherwise hold up the final drain.
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def _on_cancel(self, msg: Msg) -> None:
        gone = self.gone.get(msg.subject.partition(".")[2])
        if gone is not None:
            gone.set()

    async def _wake_on(self, stopping: asyncio.Event, stopped_at: asyncio.Future) -> None:
        """When ``stopping`` is set: note when, and wake the loop if it waits for capacity."""
        await stopping.wait()
        stopped_at.set_result(time.monotonic())
        self.capacity_freed.set()

    async def _pull(self, psub, free: int) -> None:
        """Wait for one message and start it at once, then start whatever else is already
        waiting, up to ``free``.

        Asking for ``free`` in one fetch would make the client hold the first message until the
        batch fills or the pull expires; this way a lone request starts the moment it arrives, and
        a burst still enters the engine together.
        """
        try:
            first = await psub.fetch(1, timeout=2.0)
        except TimeoutError:  # nats' TimeoutError subclasses it
            return
        except Exception as exc:  # noqa: BLE001 - NATS restarting: wait, reconnect, go on
            log.warning("pull failed (%s); retrying", exc)
            await asyncio.sleep(0.25)
            return
        waiting = 0
        for msg in first:
            self._start(msg)
            # JetStream says how many more wait for this consumer: a lone request (the common
            # case when lightly loaded) needs no second pull, which costs a round trip through NATS
            # and its 2 ms expiry while the request is already generating.
            waiting = msg.metadata.num_pending
        if free > 1 and waiting > 0:
            try:
                # nats-py turns this into a pull that waits out its (tiny) expiry when fewer are
                # queued by now; messages that arrive late stay buffered for the next fetch.
                for msg in await psub.fetch(min(free - 1, waiting), timeout=0.002):
                    self._start(msg)
            except Exception:  # noqa: BLE001 - nothing else waiting
                pass

    def _start(self, msg: Msg) -> None:
        key = f"{msg.metadata.sequence.stream}"
        self.inflight[key] = msg
        task = self.serving[key] = asyncio.create_task(self._handle(msg, key))
        task.add_done_callback(lambda _t: self._finished(key))

    def _finished(self, key: str) -> None:
        self.inflight.pop(key, None)
        self.serving.pop(key, None)
        self.capacity_freed.set()

    async def abandon(self, why: str) -> None:
        """The engine died: cancel every request still being served and nak it (no delay), so
        another replica serves it now rather than after ``ack_wait_s``."""
        held = {key: self.inflight[key] for key in self.serving if key in self.inflight}
        tasks = [self.serving[key] for key in held]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if held:
            log.error("%s: handing %d requests in flight back for another replica", why, len(held))
        for msg in held.values():
            with contextlib.suppress(Exception):  # NATS down: ack_wait_s redelivers it anyway
                await msg.nak()

    async def _hand_back(self, msg: Msg, key: str) -> None:
        """Nak for another replica, at once. Out of ``serving`` first: abandon() must not nak it a
        second time, which could redeliver it while another replica serves it."""
        self.serving.pop(key, None)
        with contextlib.suppress(Exception):  # NATS down: ack_wait_s redelivers it anyway
            await msg.nak()

    async def _handle(self, msg: Msg, key: str) -> None:
        if why := self.server.dead:  # pulled after the engine died: untouched, for another replica
            log.warning("%s: handing a pulled request back", why)
            await self._hand_back(msg, key)
            return
        try:
            item = WorkItem.model_validate_json(msg.data)
        except ValueError:
            log.error("dropping a malformed work item: %r", msg.data[:200])
            await msg.term()
            return
        ctx = context_from_headers(msg.headers)
        with _tracer.start_as_current_span("inference.serve", context=ctx) as span:
            span.set_attribute("loopline.request_id", item.request_id)
            span.set_attribute("loopline.route", item.route)
            try:
                result = await self._serve(item)
            except EngineDead as exc:  # not this request's fault: another replica serves it
                log.warning("serving %s: %s; handing it back", item.request_id, exc)
                await self._hand_back(msg, key)
                return
            except Exception as exc:  # an engine failure: let another replica try
                if why := self.server.dead:
                    log.warning("serving %s: %s (%s); handing it back", item.request_id, why, exc)
                    await self._hand_back(msg, key)
                    return
                log.exception("serving %s failed", item.request_id)
                if msg.metadata.num_delivered < self.max_deliver:
                    await msg.nak(delay=1.0)
                    return
                # As a dead letter is: the service failed it, every time; trying later may work.
                result = self._error(item, 503, f"serving failed on every delivery ({exc}); retry later",
                                     "server_error")
            # Served: from here on the answer goes out whatever happens to the engine.
            self.serving.pop(key, None)
            span.set_attribute("http.status_code", result.status)
            payload = result.model_dump_json().encode()
            if len(payload) > self.nc.max_payload:
                # Compressed and still more than NATS carries: say so rather than retry forever.
                why = (f"the answer is {len(payload)} bytes compressed, more than the message bus carries "
                       f"({self.nc.max_payload}); ask for fewer tokens, choices or logprobs")
                result = self._error(item, 413, why)
                payload = result.model_dump_json().encode()
            if item.reply_to:
                # The waiting gateway hears now, in the same write as the stored copy below, not
                # after JetStream's ack. The stored copy stays the record: only it lets us ack the
                # work, and it serves ScalarLM's polling, the ledger and a gateway that missed this.
                await self.nc.publish(item.reply_to, payload)
            await bus.publish_durable(
                self.js, subjects.result(item.group, item.index), payload, msg_id=item.request_id,
            )
            await msg.ack()
            self.served += 1

    async def _serve(self, item: WorkItem) -> ResultItem:
        if item.adapter is None:
            return await self._serve_with(item, None)
        if self.adapters is None:
            return self._error(item, 404, f"model {item.model!r}: this replica serves no adapters")
        # Pinned for the whole request: a newer checkpoint loaded meanwhile serves later requests.
        try:
            version = await self.adapters.acquire(item.adapter)
        except AdapterUnavailable as exc:
            if exc.status >= 500 and exc.retry:
                raise  # NATS restarting: nak, so this or another replica tries again
            return self._error(item, exc.status, exc.message,
                               "server_error" if exc.status >= 500 else "invalid_request_error")
        try:
            return await self._serve_with(item, version)
        finally:
            await self.adapters.release(version)

    async def _serve_with(self, item: WorkItem, version: Version | None) -> ResultItem:
        started = time.time()
        body = item.body.encode()
        stamp = None
        if version is not None:
            # vLLM knows the pinned version by its registered name (vllm_server.load_adapter); the
            # answer names what the client asked for, and the version in system_fingerprint.
            body = with_model(body, version.handle.lora_name)
            stamp = VersionStamp(version.handle.lora_name, item.model, f"{version.job_hash}@{version.step}")
        subject = subjects.token_stream(item.request_id) if item.stream else None
        transcript: list[bytes] = []  # a stream's events as the client gets them (stamped)

        async def on_event(event: bytes) -> None:
            if self.server.dead:
                return  # the engine's dying words (an error event): another replica serves it
            if stamp is not None:
                event = stamp.apply(event)
            if subject is not None:
                # Core NATS, fire and forget: the durable answer is the result's transcript.
                await self.nc.publish(subject, stream_event(len(transcript), event))
            transcript.append(event)

        gone = self.gone[item.request_id] = asyncio.Event()
        try:
            # A full fine-tune's version has an engine of its own (full_weights.py).
            engine: VllmServer | FullWeightsModel = self.server
            if version is not None and isinstance(version.handle, FullWeightsModel):
                engine = version.handle
            answer = await engine.call(item.route, body, on_event, gone=gone)
        finally:
            self.gone.pop(item.request_id, None)
        if why := self.server.dead:
            # vLLM answered with the engine's death (its 500 for EngineDeadError), or the answer
            # may be cut short: neither is this request's answer.
            raise EngineDead(why)
        if answer.streamed:
            raw = b"".join(transcript)
        else:
            raw = stamp.apply(answer.body) if stamp is not None else answer.body
        text = raw.decode("utf-8", "replace")
        prompt_tokens, completion_tokens = usage_of(raw, answer.streamed)
        return ResultItem(
            request_id=item.request_id, group=item.group, index=item.index, model=item.model,
            status=answer.status, **ResultItem.with_body(text), media_type=answer.media_type,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            error=error_of(answer.status, raw), replica=self.replica, started_at=started,
            adapter_step=version.step if version is not None else None,
        )

    def _error(self, item: WorkItem, status: int, message: str, kind: str = "invalid_request_error"):
        return ResultItem.failure(item, ErrorInfo(status=status, message=message, type=kind), self.replica)

    async def _keep_inflight_alive(self) -> None:
        """Tell JetStream that long generations are still being worked on, so it does not
        redeliver them to another replica while this one is healthy."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for msg in list(self.inflight.values()):
                try:
                    await msg.in_progress()
                except Exception:  # noqa: BLE001 - NATS down: redelivery will sort it out
                    pass

    async def _drain(self, deadline: float) -> None:
        """Wait for the requests in flight to finish, until ``deadline`` (time.monotonic())."""
        if self.inflight:
            log.info("stopping: finishing %d requests in flight", len(self.inflight))
        # Invariant: every request still in self.inflight is generating or publishing its result.
        while self.inflight and time.monotonic() < deadline:
            self.capacity_freed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.capacity_freed.wait(), deadline - time.monotonic())
        if self.inflight:
            log.warning("%d requests still in flight after the drain: JetStream redelivers them",
                        len(self.inflight))
