"""Dead letters: a work item that no replica completed within its consumer's ``max_deliver``.

JetStream stops delivering such a message and announces it with an advisory (which the
ADVISORIES stream keeps for us), but keeps the message in
WORK. We answer the client with a 503 result (otherwise it would poll forever), record the dead
letter, and delete the message so it is not retained until max-age.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ValidationError
from sqlalchemy import Engine

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ErrorInfo, ResultItem, WorkItem
from loopline.common.runtime import bus
from loopline.queue import ledger
from loopline.queue.records import DeadLetter, MaxDeliveriesAdvisory

log = logging.getLogger(__name__)


def failure_result(item: WorkItem, deliveries: int) -> ResultItem:
    return ResultItem.failure(
        item,
        ErrorInfo(
            status=503,
            message=(
                f"request {item.request_id} failed: no inference replica completed it after "
                f"{deliveries} deliveries; resubmit it or check the inference service logs"
            ),
            type="server_error",
        ),
    )


class DeadLetters:
    def __init__(self, nc: NATS, js: JetStreamContext, engine: Engine) -> None:
        self._nc = nc
        self._js = js
        self._engine = engine

    async def run(self, stopping: asyncio.Event) -> None:
        # The ADVISORIES stream keeps every max-deliveries advisory until a queue replica acks it,
        # so none is lost while the queue service is down; replicas share the durable consumer.
        psub = await self._js.pull_subscribe_bind(subjects.DEAD_LETTERS_DURABLE,
                                                  stream=subjects.ADVISORIES_STREAM)
        # Invariant: an advisory is acked only after it is handled to the end (result published,
        # dead letter recorded, message deleted); each step is idempotent, so an advisory
        # redelivered after a crash half-way changes nothing.
        while not stopping.is_set():
            try:
                msgs = await psub.fetch(16, timeout=0.5)
            except TimeoutError:  # nats.errors.TimeoutError subclasses it
                continue
            except Exception as exc:  # noqa: BLE001 - NATS restarting
                log.warning("dead letters: fetch failed: %s", exc)
                await asyncio.sleep(0.25)
                continue
            for msg in msgs:
                try:
                    await self.handle(MaxDeliveriesAdvisory.from_json(msg.data))
                except Exception:  # one bad advisory must not stop the others
                    log.exception("handling max-deliveries advisory %r failed", msg.data[:200])
                    await msg.nak(delay=1.0)
                    continue
                await msg.ack()
        await psub.unsubscribe()

    async def handle(self, advisory: MaxDeliveriesAdvisory) -> None:
        if advisory.stream != subjects.WORK_STREAM:
            return
        try:
            raw = await self._js.get_msg(subjects.WORK_STREAM, advisory.stream_seq)
        except NotFoundError:
            return  # handled already (we delete the message last), or purged by clear_queue
        try:
            item = WorkItem.model_validate_json(raw.data or b"")
        except ValidationError:
            log.error("dead letter %d in WORK is not a work item; deleting it", advisory.stream_seq)
            await self._delete(advisory.stream_seq)
            return

        result = failure_result(item, advisory.deliveries)
        # Same Nats-Msg-Id as a real result, so whichever of the two comes second is dropped.
        await bus.publish_durable(
            self._js,
            subjects.result(item.group, item.index),
            result.model_dump_json().encode(),
            msg_id=item.request_id,
        )
        letter = DeadLetter(
            request_id=item.request_id,
            stream_seq=advisory.stream_seq,
            deliveries=advisory.deliveries,
            payload=(raw.data or b"").decode(errors="replace"),
            failed_at=time.time(),
        )
        await asyncio.to_thread(ledger.write_dead_letter, self._engine, letter)
        await self._delete(advisory.stream_seq)
        log.warning(
            "request %s dead-lettered after %d deliveries on %s",
            item.request_id,
            advisory.deliveries,
            advisory.consumer,
        )

    async def _delete(self, seq: int) -> None:
        try:
            await self._js.delete_msg(subjects.WORK_STREAM, seq)
        except NotFoundError:
            pass
