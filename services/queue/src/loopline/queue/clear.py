"""clear_queue: fail every prompt still in WORK with a 'cancelled' result, then purge it.

WORK itself, not the ledger, says what is queued: the ledger lags JetStream a little, and a prompt
published a moment ago must not be purged without its client hearing about it.
"""

from __future__ import annotations

import asyncio
import logging

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ErrorInfo, ResultItem, WorkItem
from loopline.common.runtime import bus

log = logging.getLogger(__name__)

# Publishes and lookups in flight at once; enough to pipeline, few enough not to flood the server.
CONCURRENCY = 128


def cancelled_result(item: WorkItem) -> ResultItem:
    return ResultItem.failure(
        item, ErrorInfo(status=410, message="request cleared from the queue by clear_queue", type="cancelled")
    )


async def queued_work(js: JetStreamContext) -> tuple[list[WorkItem], int]:
    """The work items in WORK now, and the highest sequence read (0 when there were none).

    Reading stops at the sequence the stream had when we started, so a steady stream of new
    prompts cannot keep the clear going forever; those are left for the next clear.
    """
    state = (await js.stream_info(subjects.WORK_STREAM)).state
    if not state.messages:
        return [], 0
    items: list[WorkItem] = []
    seq, last_read = max(state.first_seq, 1), 0
    # Invariant: every WORK message with a sequence below ``seq`` has been read (and, if it is a
    # work item, is in ``items``); ``last_read`` is the highest of them.
    while seq <= state.last_seq:
        try:
            raw = await js.get_msg(subjects.WORK_STREAM, seq=seq, subject=subjects.WORK_ALL, next=True)
        except NotFoundError:
            break
        if raw.seq is None or raw.seq > state.last_seq:
            break
        last_read, seq = raw.seq, raw.seq + 1
        try:
            items.append(WorkItem.model_validate_json(raw.data or b""))
        except ValidationError:
            log.warning("WORK message %d is not a work item; purging it anyway", raw.seq)
    return items, last_read


async def _has_result(js: JetStreamContext, item: WorkItem) -> bool:
    try:
        raw = await js.get_last_msg(
            subjects.RESULTS_STREAM, subjects.result(item.group, item.index), direct=True
        )
    except NotFoundError:
        return False
    try:
        return ResultItem.model_validate_json(raw.data or b"").request_id == item.request_id
    except ValidationError:
        return False


async def _cancel(js: JetStreamContext, item: WorkItem) -> bool:
    """Publish the cancelled result unless the request has its real one already."""
    # A request that finished but is still in WORK (the ledger has not acked it yet) keeps its answer;
    # the dedupe window would also drop our result, but only for the window's length.
    if await _has_result(js, item):
        return False
    await bus.publish_durable(
        js,
        subjects.result(item.group, item.index),
        cancelled_result(item).model_dump_json().encode(),
        msg_id=item.request_id,
    )
    return True


async def clear_queue(js: JetStreamContext) -> int:
    """Returns how many requests were cancelled."""
    items, last_read = await queued_work(js)
    if not last_read:
        return 0
    cleared = 0
    for start in range(0, len(items), CONCURRENCY):
        chunk = items[start : start + CONCURRENCY]
        cleared += sum(await asyncio.gather(*(_cancel(js, item) for item in chunk)))
    # Results first, purge second: a crash in between leaves the prompts queued and a second
    # clear (its results deduplicated) finishes the job, where the other order would lose them.
    await js.purge_stream(subjects.WORK_STREAM, subject=subjects.WORK_ALL, seq=last_read + 1)
    log.info("clear_queue cancelled %d requests (WORK purged through seq %d)", cleared, last_read)
    return cleared
