"""The ledger's two feeds: pull work items from WORK and results from RESULTS, write them to SQL in
batches, ack them after the commit.

The hot path never waits on this: the gateway is done once JetStream has the work item, and the
ledger catches up from its durable consumers, even after being down for a while.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError
from sqlalchemy import Engine
from sqlalchemy.exc import DataError, IntegrityError

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem, WorkItem
from loopline.common.runtime.service import pause
from loopline.queue import ledger

log = logging.getLogger(__name__)

Item = TypeVar("Item", WorkItem, ResultItem)

# How long one fetch waits for a first message; also the longest a shutdown waits on this loop.
FETCH_WAIT_S = 1.0
RETRY_DELAY_S = 1.0

ROWS = Counter("loopline_queue_ledger_rows", (
    "Messages the ledger has handled, by feed (work, results) and outcome: written (committed), "
    "refused (the database refuses the row), unparsable (not a work item or result)."),
    ["feed", "outcome"])
WRITE_FAILURES = Counter("loopline_queue_ledger_write_failures", (
    "Batches whose transaction failed (the database unreachable); their messages are redelivered."),
    ["feed"])


@dataclass
class Feed(Generic[Item]):
    """One durable consumer and how to write what it delivers."""

    name: str
    stream: str
    durable: str
    schema: type[Item]
    write: Callable[[Engine, list[Item]], None]


WORK_FEED = Feed(
    "work", subjects.WORK_STREAM, subjects.LEDGER_WORK_DURABLE, WorkItem, ledger.write_work_items
)
RESULTS_FEED = Feed(
    "results", subjects.RESULTS_STREAM, subjects.LEDGER_RESULTS_DURABLE, ResultItem, ledger.write_results
)


async def run_feed(
    feed: Feed,
    js: JetStreamContext,
    engine: Engine,
    *,
    batch: int,
    linger_s: float,
    stopping: asyncio.Event,
) -> None:
    sub = await js.pull_subscribe_bind(feed.durable, feed.stream)
    # Unsubscribed however the loop ends: a pull subscription left behind by a loop that died
    # keeps its undelivered messages, and the final drain of the connection waits for them.
    try:
        # Invariant: a message is acked only after the transaction holding its row has committed (or
        # termed, when it can never be written). A crash anywhere in between re-delivers it, and the
        # upserts make the second write a no-op.
        while not stopping.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=FETCH_WAIT_S)
            except TimeoutError:
                # nats-py raises its own TimeoutError or a bare asyncio one depending on where the
                # wait ran out; the first subclasses the second.
                continue
            except Exception as exc:  # noqa: BLE001 - reconnects surface here; keep pulling
                log.warning("ledger %s: fetch failed: %s", feed.name, exc)
                await pause(stopping, RETRY_DELAY_S)
                continue

            items: list[BaseModel] = []
            good: list[Msg] = []
            for msg in msgs:
                try:
                    items.append(feed.schema.model_validate_json(msg.data))
                    good.append(msg)
                except ValidationError as exc:
                    # Redelivering a payload that cannot parse would only fail again, forever.
                    log.error("ledger %s: dropping unparsable message %s: %s", feed.name, msg.subject, exc)
                    ROWS.labels(feed.name, "unparsable").inc()
                    await msg.term()

            try:
                refused = await _write(feed, engine, items, good)
            except Exception:  # the database may be restarting; let JetStream retry
                log.exception(
                    "ledger %s: writing %d rows failed; they will be redelivered", feed.name, len(items)
                )
                WRITE_FAILURES.labels(feed.name).inc()
                for msg in good:
                    await msg.nak(delay=RETRY_DELAY_S)
                await pause(stopping, RETRY_DELAY_S)
                continue

            ROWS.labels(feed.name, "written").inc(len(good) - len(refused))
            ROWS.labels(feed.name, "refused").inc(len(refused))
            refused_ids = {id(msg) for msg in refused}
            for msg in good:
                if id(msg) in refused_ids:
                    await msg.term()
                else:
                    await msg.ack()
            if len(msgs) < batch:
                # Caught up: let the next rows gather instead of writing them a few at a time while
                # a burst is still arriving; bigger transactions cost the shared CPU less per row.
                await pause(stopping, linger_s)
    finally:
        await sub.unsubscribe()


async def _write(feed: Feed, engine: Engine, items: list, msgs: list[Msg]) -> list[Msg]:
    """Write the batch in one transaction; returns the messages whose rows the database refused.

    A row the database refuses for its content (an id longer than its column, say) would fail the
    batch on every redelivery and hold the rest back forever, so then the batch is written again
    one row at a time and only the refused rows are dropped.
    """
    try:
        await asyncio.to_thread(feed.write, engine, items)
        return []
    except (DataError, IntegrityError):
        if len(items) == 1:
            log.exception(
                "ledger %s: the database refuses %.120s; dropping it", feed.name, items[0].request_id
            )
            return list(msgs)
    refused: list[Msg] = []
    for item, msg in zip(items, msgs, strict=True):
        refused += await _write(feed, engine, [item], [msg])
    return refused
