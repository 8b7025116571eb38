"""End to end: the queue service, as its own process, writes the ledger from WORK and RESULTS."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ErrorInfo, ResultItem, WorkItem
from loopline.common.db.engine import open_database
from loopline.common.db.rows import BatchRow, RequestRow
from loopline.common.local import launcher
from loopline.common.runtime import bus


def work(group: str, index: int, request_id: str | None = None) -> WorkItem:
    return WorkItem(
        request_id=request_id or f"{group}_{index}",
        group=group,
        index=index,
        model="tiny",
        route="/v1/completions",
        body=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}),
    )


def result(item: WorkItem, tokens: int = 0, error: str | None = None) -> ResultItem:
    if error:
        return ResultItem.failure(item, ErrorInfo(status=500, message=error), replica="replica-a")
    return ResultItem(
        request_id=item.request_id,
        group=item.group,
        index=item.index,
        model=item.model,
        body=json.dumps({"choices": [{"index": 0, "text": "y" * tokens}]}),
        prompt_tokens=3,
        completion_tokens=tokens,
        replica="replica-a",
    )


async def publish_work(js, item: WorkItem, deployment: str = "dep") -> None:
    await bus.publish_durable(
        js, subjects.work(deployment), item.model_dump_json().encode(), msg_id=item.request_id
    )


async def publish_result(js, item: ResultItem) -> None:
    await bus.publish_durable(
        js, subjects.result(item.group, item.index), item.model_dump_json().encode(), msg_id=item.request_id
    )


async def test_work_then_results_reach_the_ledger(database_url, js, start_queue, eventually):
    proc = await start_queue(database_url=database_url)

    # Three prompts of a /v1/generate batch of five, carrying the batch as the gateway writes it,
    # and a hand-made OpenAI item without (its kind and total are inferred).
    # An id too long for its column: PostgreSQL refuses the row, which must not block the others.
    await publish_work(js, work("poison", 0, request_id="p" * 200))
    items = [work("g", i).model_copy(update={"kind": "generate", "batch_total": 5}) for i in range(3)]
    items.append(work("chatcmpl-9", 0, request_id="chatcmpl-9"))
    for item in items:
        await publish_work(js, item)

    engine = open_database(database_url)
    try:

        def rows() -> dict[str, RequestRow]:
            with Session(engine) as s:
                return {r.request_id: r for r in s.scalars(sa.select(RequestRow))}

        names = {item.request_id for item in items}
        queued = await eventually(lambda: names <= set(rows()) and rows())
        assert {queued[k].status for k in names} == {"queued"}

        await publish_result(js, result(items[0], tokens=5))
        await publish_result(js, result(items[1], tokens=7))
        await publish_result(js, result(items[2], error="engine crashed"))
        # A duplicate publish (a replica retrying) is dropped by JetStream; the ledger is unchanged.
        await publish_result(js, result(items[0], tokens=5))

        done = await eventually(
            lambda: all(rows()[k].status != "queued" for k in ("g_0", "g_1", "g_2")) and rows()
        )
        assert (done["g_0"].status, done["g_0"].completion_tokens, done["g_0"].prompt_tokens) == (
            "completed",
            5,
            3,
        )
        assert (done["g_1"].status, done["g_1"].completion_tokens) == ("completed", 7)
        assert (done["g_2"].status, done["g_2"].error) == ("failed", "engine crashed")
        assert done["g_0"].replica == "replica-a" and done["g_0"].completed_at is not None
        assert done["chatcmpl-9"].status == "queued"

        with Session(engine) as s:
            kinds = {b.group_id: (b.kind, b.total) for b in s.scalars(sa.select(BatchRow))}
        assert kinds["g"] == ("generate", 5)  # the gateway's total, not the 3 seen so far
        assert kinds["chatcmpl-9"] == ("openai", 1)

        # Nothing is stuck in the ledger's consumers (the refused row was dropped, not retried).
        async def settled(stream: str, durable: str) -> bool:
            info = await js.consumer_info(stream, durable)
            return (info.num_pending, info.num_ack_pending) == (0, 0)

        await eventually(lambda: settled(subjects.WORK_STREAM, subjects.LEDGER_WORK_DURABLE))
        await eventually(lambda: settled(subjects.RESULTS_STREAM, subjects.LEDGER_RESULTS_DURABLE))
    finally:
        engine.dispose()

    # SIGTERM is a clean stop.
    launcher.stop(proc)
    assert proc.popen.returncode == 0, proc.log_tail()
    assert "stopped (exit 0)" in proc.log_tail()


async def test_ledger_catches_up_after_a_restart(js, start_queue, eventually, tmp_path):
    """Written while the service is down, read when it is back: the consumers are durable."""
    proc = await start_queue()
    launcher.stop(proc)
    item = work("late", 0)
    await publish_work(js, item)
    await publish_result(js, result(item, tokens=2))

    await start_queue()
    engine = open_database(f"sqlite:///{tmp_path / 'loopline.db'}")
    try:

        def status():
            with Session(engine) as s:
                row = s.get(RequestRow, "late_0")
                return row and (row.status, row.completion_tokens)

        assert await eventually(lambda: status() == ("completed", 2))
    finally:
        engine.dispose()
