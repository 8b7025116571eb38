"""The ledger's SQL writer, called directly, on SQLite and PostgreSQL."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loopline.common.contracts.schemas import ErrorInfo, ResultItem, WorkItem
from loopline.common.db.engine import migrate, open_database
from loopline.common.db.rows import BatchRow, DeadLetterRow, RequestRow
from loopline.queue import ledger
from loopline.queue.records import DeadLetter


def work(group: str, index: int, at: float = 100.0, request_id: str | None = None) -> WorkItem:
    return WorkItem(
        request_id=request_id or f"{group}_{index}",
        group=group,
        index=index,
        model="tiny",
        route="/v1/completions",
        body=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}),
        submitted_at=at,
    )


def result(
    group: str,
    index: int,
    tokens: int = 3,
    finished: float = 110.0,
    error: str | None = None,
    request_id: str | None = None,
) -> ResultItem:
    failure = ErrorInfo(status=500, message=error) if error else None
    answer = json.dumps({"choices": [{"index": 0, "text": "x" * tokens}]})
    return ResultItem(
        request_id=request_id or f"{group}_{index}",
        group=group,
        index=index,
        model="tiny",
        status=failure.status if failure else 200,
        body=failure.openai_body() if failure else answer,
        prompt_tokens=2,
        completion_tokens=0 if error else tokens,
        replica="r1",
        started_at=105.0,
        finished_at=finished,
        error=failure,
    )


def requests(engine) -> dict[str, RequestRow]:
    with Session(engine) as s:
        return {r.request_id: r for r in s.scalars(sa.select(RequestRow))}


def batches(engine) -> dict[str, BatchRow]:
    with Session(engine) as s:
        return {b.group_id: b for b in s.scalars(sa.select(BatchRow))}


def test_work_then_results_complete_the_rows(engine):
    ledger.write_work_items(engine, [work("g", i) for i in range(3)])
    rows = requests(engine)
    assert {r.status for r in rows.values()} == {"queued"}
    assert rows["g_0"].enqueued_at == 100.0

    ledger.write_results(
        engine, [result("g", 0, tokens=5), result("g", 1, tokens=7), result("g", 2, error="engine died")]
    )
    rows = requests(engine)
    assert (rows["g_0"].status, rows["g_0"].completion_tokens, rows["g_0"].prompt_tokens) == (
        "completed",
        5,
        2,
    )
    assert (rows["g_1"].status, rows["g_1"].completion_tokens) == ("completed", 7)
    assert (rows["g_2"].status, rows["g_2"].error) == ("failed", "engine died")
    assert rows["g_0"].completed_at == 110.0 and rows["g_0"].started_at == 105.0
    assert rows["g_0"].replica == "r1"
    # The enqueue time is the work item's, not the result's.
    assert rows["g_1"].enqueued_at == 100.0
    b = batches(engine)["g"]
    assert (b.kind, b.total, b.model, b.created_at) == ("generate", 3, "tiny", 100.0)


def test_result_before_work_item_and_duplicates(engine):
    # The result overtakes its work item: the row is created from the result...
    ledger.write_results(engine, [result("g", 1, tokens=4)])
    row = requests(engine)["g_1"]
    assert (row.status, row.completion_tokens) == ("completed", 4)
    # ...and the late work item fixes the enqueue time without reopening the request.
    ledger.write_work_items(engine, [work("g", 1, at=90.0), work("g", 0, at=91.0)])
    rows = requests(engine)
    assert (rows["g_1"].status, rows["g_1"].completion_tokens, rows["g_1"].enqueued_at) == (
        "completed",
        4,
        90.0,
    )
    assert rows["g_0"].status == "queued"

    # Redeliveries, one batch holding the same item twice included, change nothing.
    before = {k: (r.status, r.enqueued_at, r.completed_at, r.completion_tokens) for k, r in rows.items()}
    ledger.write_work_items(engine, [work("g", 1, at=90.0), work("g", 1, at=90.0), work("g", 0, at=91.0)])
    ledger.write_results(engine, [result("g", 1, tokens=4), result("g", 1, tokens=4)])
    after = {
        k: (r.status, r.enqueued_at, r.completed_at, r.completion_tokens) for k, r in requests(engine).items()
    }
    assert after == before

    # Of two results the later one wins, whatever order they are written in.
    ledger.write_results(engine, [result("g", 0, tokens=9, finished=120.0)])
    ledger.write_results(engine, [result("g", 0, error="stale", finished=115.0)])
    row = requests(engine)["g_0"]
    assert (row.status, row.completion_tokens, row.error) == ("completed", 9, None)

    assert len(requests(engine)) == 2
    assert batches(engine)["g"].total == 2


def test_batch_kind_and_total(engine):
    # An OpenAI request is a group of one with a bare id.
    ledger.write_work_items(engine, [work("chatcmpl-1", 0, request_id="chatcmpl-1")])
    # Without the gateway's figures the total grows with the highest index seen.
    ledger.write_work_items(engine, [work("g", 1)])
    ledger.write_work_items(engine, [work("g", 4, at=50.0)])
    # With them, they are the truth, even when a result got there first and the kind was guessed
    # from its id ("generate", for an id with an index).
    ledger.write_results(engine, [result("u", 3)])
    upload = work("u", 0, at=42.0).model_copy(update={"kind": "upload", "batch_total": 10})
    ledger.write_work_items(engine, [upload])
    # A later inferred sighting changes neither.
    ledger.write_results(engine, [result("u", 0)])

    b = batches(engine)
    assert (b["chatcmpl-1"].kind, b["chatcmpl-1"].total) == ("openai", 1)
    assert (b["g"].kind, b["g"].total, b["g"].created_at) == ("generate", 5, 50.0)
    assert (b["u"].kind, b["u"].total, b["u"].created_at) == ("upload", 10, 42.0)


def test_dead_letter_written_once(engine):
    letter = DeadLetter(request_id="g_0", stream_seq=7, deliveries=2, payload="{}", failed_at=1.0)
    ledger.write_dead_letter(engine, letter)
    ledger.write_dead_letter(
        engine, DeadLetter(request_id="g_0", stream_seq=7, deliveries=3, payload="{}", failed_at=2.0)
    )
    with Session(engine) as s:
        rows = s.scalars(sa.select(DeadLetterRow)).all()
    assert [(r.request_id, r.stream_seq, r.deliveries, r.failed_at) for r in rows] == [("g_0", 7, 2, 1.0)]


def test_totals(engine):
    assert ledger.totals(engine).completed == 0
    ledger.write_work_items(engine, [work("g", i, at=100.0 + i) for i in range(4)])
    ledger.write_results(
        engine,
        [
            result("g", 0, tokens=5, finished=104.0),
            result("g", 1, tokens=7, finished=103.0),
            result("g", 2, error="boom", finished=102.0),
        ],
    )
    t = ledger.totals(engine)
    assert (t.completed, t.failed, t.completion_tokens) == (2, 1, 12)
    assert (t.first_enqueued_at, t.last_completed_at) == (100.0, 104.0)


def test_migrating_twice_is_a_no_op(database_url):
    engine = open_database(database_url)
    try:
        migrate(engine)
        ledger.write_work_items(engine, [work("g", 0)])
        migrate(engine)  # must neither fail nor recreate the tables
        assert list(requests(engine)) == ["g_0"]
        with engine.connect() as conn:
            versions = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
        assert len(versions) == 1
    finally:
        engine.dispose()
