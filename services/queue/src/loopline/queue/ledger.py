"""The request ledger's SQL: idempotent upserts from work items and results, dead letters, and the
aggregates behind the metrics endpoint.

Every function here is synchronous and is called through ``asyncio.to_thread``, so the event loop
never waits on the database. Writes are upserts because JetStream delivers at least once: the same
work item or result may arrive twice, and a result may arrive before its work item.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict

from sqlalchemy import Engine, Table, case, func, select
from sqlalchemy.dialects import postgresql, sqlite

from loopline.common.contracts.schemas import ResultItem, WorkItem
from loopline.common.db.rows import BatchRow, DeadLetterRow, RequestRow
from loopline.queue.records import DeadLetter, LedgerTotals

QUEUED = "queued"
COMPLETED = "completed"
FAILED = "failed"

REQUESTS: Table = RequestRow.__table__  # type: ignore[assignment]
BATCHES: Table = BatchRow.__table__  # type: ignore[assignment]
DEAD_LETTERS: Table = DeadLetterRow.__table__  # type: ignore[assignment]

# /v1/generate prompts are "<group>_<index>"; an OpenAI request is its own group with a bare id.
_INDEX_SUFFIX = re.compile(r"_\d+$")


def infer_kind(request_id: str) -> str:
    return "generate" if _INDEX_SUFFIX.search(request_id) else "openai"


def _insert(engine: Engine, table: Table):
    # Both dialects spell "INSERT ... ON CONFLICT" the same way in SQLAlchemy; only the import differs.
    dialect = engine.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise RuntimeError(f"the ledger supports SQLite and PostgreSQL, not {dialect}")


# --- batches -------------------------------------------------------------------------------------


def _batch_values(seen: Iterable[tuple[str, str, int, str, float, str | None, int | None]]) -> list[dict]:
    """One batches row per group from (group, request_id, index, model, at, kind, total) sightings.

    The kind and total the gateway put on the work item are the truth when present; otherwise the
    kind is read off the request id and the total is the highest index seen so far plus one (grown
    by later writes). ``known`` says which of the two a row is.
    """
    rows: dict[str, dict] = {}
    for group, request_id, index, model, at, kind, total in seen:
        row = rows.get(group)
        if row is None:
            row = rows[group] = {
                "group_id": group,
                "kind": kind or infer_kind(request_id),
                "model": model,
                "total": total or 0,
                "created_at": at,
                "known": kind is not None,
            }
        row["total"] = max(row["total"], index + 1)
        row["created_at"] = min(row["created_at"], at)
    return [rows[g] for g in sorted(rows)]


def _upsert_batches(conn, engine: Engine, values: list[dict]) -> None:
    """Known rows (from the gateway's own figures) overwrite an inferred kind; inferred rows only
    grow the total and move the creation time earlier, whichever arrives first."""
    for known in (False, True):
        rows = [{k: v for k, v in row.items() if k != "known"} for row in values if row["known"] is known]
        if not rows:
            continue
        ins = _insert(engine, BATCHES)
        grows = ins.excluded.total > BATCHES.c.total
        earlier = ins.excluded.created_at < BATCHES.c.created_at
        update = {
            "total": case((grows, ins.excluded.total), else_=BATCHES.c.total),
            "created_at": case((earlier, ins.excluded.created_at), else_=BATCHES.c.created_at),
        }
        if known:
            update["kind"] = ins.excluded.kind
        stmt = ins.on_conflict_do_update(
            index_elements=[BATCHES.c.group_id],
            set_=update,
            where=(grows | earlier | (ins.excluded.kind != BATCHES.c.kind)) if known else (grows | earlier),
        )
        conn.execute(stmt, rows)


# --- requests ------------------------------------------------------------------------------------


def write_work_items(engine: Engine, items: list[WorkItem]) -> None:
    """Record enqueued prompts as 'queued'. A row that exists (a redelivery, or a result that beat
    its work item here) keeps its status; only its enqueue time moves earlier to the true one."""
    if not items:
        return
    first: dict[str, WorkItem] = {}
    for item in items:
        if item.request_id not in first or item.submitted_at < first[item.request_id].submitted_at:
            first[item.request_id] = item
    # Sorted keys give every transaction the same lock order, so two writers never deadlock.
    ordered = [first[k] for k in sorted(first)]
    values = [
        {
            "request_id": w.request_id,
            "group_id": w.group,
            "idx": w.index,
            "model": w.model,
            "status": QUEUED,
            "enqueued_at": w.submitted_at,
            "started_at": None,
            "completed_at": None,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "replica": None,
            "error": None,
        }
        for w in ordered
    ]
    ins = _insert(engine, REQUESTS)
    stmt = ins.on_conflict_do_update(
        index_elements=[REQUESTS.c.request_id],
        set_={"enqueued_at": ins.excluded.enqueued_at},
        where=ins.excluded.enqueued_at < REQUESTS.c.enqueued_at,
    )
    batches = _batch_values(
        (w.group, w.request_id, w.index, w.model, w.submitted_at, w.kind, w.batch_total) for w in ordered
    )
    with engine.begin() as conn:
        _upsert_batches(conn, engine, batches)
        conn.execute(stmt, values)


def write_results(engine: Engine, results: list[ResultItem]) -> None:
    """Record outcomes: 'completed', or 'failed' when the result carries an error. A result whose
    work item has not been seen yet creates the row; of two results for one request the one that
    finished last wins, which is also the one a client reading RESULTS last-by-subject sees."""
    if not results:
        return
    last: dict[str, ResultItem] = {}
    for r in results:
        if r.request_id not in last or r.finished_at >= last[r.request_id].finished_at:
            last[r.request_id] = r
    ordered = [last[k] for k in sorted(last)]
    values = [
        {
            "request_id": r.request_id,
            "group_id": r.group,
            "idx": r.index,
            "model": r.model,
            "status": FAILED if r.error else COMPLETED,
            # Only a placeholder until the work item arrives with the real submission time.
            "enqueued_at": r.started_at or r.finished_at,
            "started_at": r.started_at or None,
            "completed_at": r.finished_at,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "replica": r.replica or None,
            "error": r.error.message if r.error else None,
        }
        for r in ordered
    ]
    ins = _insert(engine, REQUESTS)
    x = ins.excluded
    stmt = ins.on_conflict_do_update(
        index_elements=[REQUESTS.c.request_id],
        set_={
            "status": x.status,
            "started_at": func.coalesce(x.started_at, REQUESTS.c.started_at),
            "completed_at": x.completed_at,
            "prompt_tokens": x.prompt_tokens,
            "completion_tokens": x.completion_tokens,
            "replica": x.replica,
            "error": x.error,
        },
        where=REQUESTS.c.completed_at.is_(None) | (x.completed_at >= REQUESTS.c.completed_at),
    )
    batches = _batch_values(
        (r.group, r.request_id, r.index, r.model, r.started_at or r.finished_at, None, None)
        for r in ordered
    )
    with engine.begin() as conn:
        _upsert_batches(conn, engine, batches)
        conn.execute(stmt, values)


# --- dead letters --------------------------------------------------------------------------------


def write_dead_letter(engine: Engine, letter: DeadLetter) -> None:
    """Keep the first record of a dead letter; a repeated advisory changes nothing."""
    stmt = _insert(engine, DEAD_LETTERS).on_conflict_do_nothing(index_elements=[DEAD_LETTERS.c.request_id])
    with engine.begin() as conn:
        conn.execute(stmt, [asdict(letter)])


# --- reads ---------------------------------------------------------------------------------------


def totals(engine: Engine) -> LedgerTotals:
    """One pass over the requests table for every figure the metrics endpoint reports."""
    c = REQUESTS.c
    completed = c.status == COMPLETED
    stmt = select(
        func.coalesce(func.sum(case((completed, 1), else_=0)), 0),
        func.coalesce(func.sum(case((c.status == FAILED, 1), else_=0)), 0),
        func.coalesce(func.sum(c.completion_tokens), 0),
        func.min(c.enqueued_at),
        func.max(c.completed_at),
    )
    with engine.connect() as conn:
        done, failed, tokens, first, last = conn.execute(stmt).one()
    return LedgerTotals(
        completed=int(done),
        failed=int(failed),
        completion_tokens=int(tokens),
        first_enqueued_at=first,
        last_completed_at=last,
    )
