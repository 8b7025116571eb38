"""End to end: the queue service's request-reply endpoints (metrics, clear, status)."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import (
    ClearQueueReply,
    DeploymentInfo,
    ErrorInfo,
    ResultItem,
    ServiceStatus,
    WorkItem,
)
from loopline.common.db.engine import open_database
from loopline.common.db.rows import RequestRow
from loopline.common.runtime import bus


def work(group: str, index: int, at: float | None = None) -> WorkItem:
    extra = {"submitted_at": at} if at is not None else {}
    return WorkItem(
        request_id=f"{group}_{index}",
        group=group,
        index=index,
        model="m",
        route="/v1/completions",
        body=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}),
        **extra,
    )


def result(item: WorkItem, tokens: int = 0, error: bool = False, finished: float | None = None) -> ResultItem:
    extra = {"finished_at": finished} if finished is not None else {}
    if error:
        return ResultItem.failure(item, ErrorInfo(status=500, message="boom")).model_copy(update=extra)
    return ResultItem(
        request_id=item.request_id,
        group=item.group,
        index=item.index,
        model=item.model,
        body=json.dumps({"choices": [{"index": 0, "text": "z"}]}),
        completion_tokens=tokens,
        **extra,
    )


async def deploy(js, deployment: str) -> None:
    """What an inference replica does when it starts: announce the model, create the consumer."""
    models = await js.key_value(subjects.MODELS_BUCKET)
    info = DeploymentInfo(model="m", deployment=deployment, max_model_len=128, engine="vllm")
    await models.put(deployment, info.model_dump_json().encode())
    await bus.ensure_work_consumer(js, deployment, ack_wait_s=30, max_deliver=5)


async def publish(js, subject: str, item) -> None:
    await bus.publish_durable(js, subject, item.model_dump_json().encode(), msg_id=item.request_id)


async def test_metrics(nc, js, start_queue, eventually):
    await start_queue()
    await deploy(js, "dep")
    items = [work("g", i, at=1000.0 + i) for i in range(4)]
    for item in items:
        await publish(js, subjects.work("dep"), item)
    # A replica answers three (one with an error) and acks them; the fourth stays queued.
    replica = await js.pull_subscribe_bind(subjects.inference_durable("dep"), subjects.WORK_STREAM)
    taken = await replica.fetch(3, timeout=2)
    assert len(taken) == 3
    await publish(js, subjects.result("g", 0), result(items[0], tokens=5, finished=1003.0))
    await publish(js, subjects.result("g", 1), result(items[1], tokens=7, finished=1004.0))
    await publish(js, subjects.result("g", 2), result(items[2], error=True, finished=1002.0))
    for msg in taken:
        await msg.ack_sync()

    async def metrics() -> dict:
        reply = await nc.request(subjects.SVC_QUEUE_METRICS, b"", timeout=2)
        return json.loads(reply.data)

    m = await eventually(
        lambda: _when(metrics(), lambda m: m["requests"] == 2 and m["failed"] == 1 and m["queue_depth"] == 1)
    )
    assert m["tokens"] == 12
    # From the first enqueue (1000) to the last completion (1004).
    assert m["total_time"] == 4.0
    assert m["token/s"] == 3.0 and m["request/s"] == 0.5
    assert "flop/s" in m


async def _when(awaitable, predicate):
    value = await awaitable
    return value if predicate(value) else None


async def test_clear_queue_cancels_what_is_queued(nc, js, start_queue, eventually, tmp_path):
    await start_queue()
    await deploy(js, "dep")
    items = [work("c", i) for i in range(3)]
    for item in items:
        await publish(js, subjects.work("dep"), item)
    # c_0 has been answered already (its replica has not acked yet): clearing must not touch it.
    await publish(js, subjects.result("c", 0), result(items[0], tokens=3))

    reply = await nc.request(subjects.SVC_QUEUE_CLEAR, b"", timeout=10)
    assert ClearQueueReply.model_validate_json(reply.data).cleared == 2

    for index in (1, 2):
        raw = await js.get_last_msg(subjects.RESULTS_STREAM, subjects.result("c", index))
        cancelled = ResultItem.model_validate_json(raw.data)
        assert cancelled.request_id == f"c_{index}"
        assert (cancelled.error.status, cancelled.error.type) == (410, "cancelled")
        assert "clear_queue" in cancelled.error.message
        # What a client waiting on it gets: the status and OpenAI's error body.
        assert cancelled.status == 410
        assert json.loads(cancelled.text())["error"]["type"] == "cancelled"
    kept = ResultItem.model_validate_json(
        (await js.get_last_msg(subjects.RESULTS_STREAM, subjects.result("c", 0))).data
    )
    assert kept.error is None

    # Nothing is left for a replica to pull.
    info = await js.consumer_info(subjects.WORK_STREAM, subjects.inference_durable("dep"))
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    assert (await js.stream_info(subjects.WORK_STREAM)).state.messages == 0

    # The ledger records the cancellations as failures.
    engine = open_database(f"sqlite:///{tmp_path / 'loopline.db'}")
    try:

        def statuses():
            with Session(engine) as s:
                return {r.request_id: r.status for r in s.scalars(sa.select(RequestRow))}

        await eventually(lambda: statuses() == {"c_0": "completed", "c_1": "failed", "c_2": "failed"})
    finally:
        engine.dispose()

    # What is published after the clear is queued as usual, and a second clear finds only that.
    await publish(js, subjects.work("dep"), work("d", 0))
    reply = await nc.request(subjects.SVC_QUEUE_CLEAR, b"", timeout=10)
    assert ClearQueueReply.model_validate_json(reply.data).cleared == 1


async def test_status(nc, js, start_queue, eventually):
    await start_queue()
    await deploy(js, "dep")
    await publish(js, subjects.work("dep"), work("s", 0))

    async def status() -> ServiceStatus:
        reply = await nc.request(subjects.SVC_QUEUE_STATUS, b"", timeout=2)
        return ServiceStatus.model_validate_json(reply.data)

    st = await eventually(lambda: _when(status(), lambda s: s.detail["queue_depth"] == 1))
    assert (st.service, st.status) == ("queue", "up")
    assert st.detail["deployments"]["dep"] == {"pending": 1, "in_flight": 0}
