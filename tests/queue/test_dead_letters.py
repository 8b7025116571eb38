"""End to end: a work item no replica completes is failed with a 503 result and dead-lettered."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import sqlalchemy as sa
from nats.js.errors import NotFoundError
from sqlalchemy.orm import Session

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem, WorkItem
from loopline.common.db.engine import open_database
from loopline.common.db.rows import DeadLetterRow, RequestRow
from loopline.common.runtime import bus


async def test_exhausted_deliveries_fail_the_request(nc, js, start_queue, eventually, tmp_path):
    await start_queue()
    await bus.ensure_work_consumer(js, "flaky", ack_wait_s=1, max_deliver=2)
    item = WorkItem(request_id="dl_0", group="dl", index=0, model="m", route="/v1/completions",
                    body=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}))
    await bus.publish_durable(
        js, subjects.work("flaky"), item.model_dump_json().encode(), msg_id=item.request_id
    )

    # A misbehaving replica: naks the first delivery, takes the second and never answers, and keeps
    # asking for more (JetStream notices the exhausted message only when the consumer is pulled).
    replica = await js.pull_subscribe_bind(subjects.inference_durable("flaky"), subjects.WORK_STREAM)
    deliveries: list[tuple[int, int]] = []

    async def misbehave() -> None:
        while True:
            try:
                msg = (await replica.fetch(1, timeout=0.5))[0]
            except TimeoutError:
                continue
            deliveries.append((msg.metadata.sequence.stream, msg.metadata.num_delivered))
            if msg.metadata.num_delivered == 1:
                await msg.nak()

    misbehaving = asyncio.create_task(misbehave())

    async def failure() -> ResultItem | None:
        try:
            raw = await js.get_last_msg(subjects.RESULTS_STREAM, subjects.result("dl", 0))
        except NotFoundError:
            return None
        return ResultItem.model_validate_json(raw.data)

    try:
        res = await eventually(failure, timeout_s=10)
    finally:
        misbehaving.cancel()
    assert [n for _, n in deliveries] == [1, 2]
    seq = deliveries[0][0]
    assert res.request_id == "dl_0"
    assert res.error is not None and res.error.status == 503 and res.error.type == "server_error"
    assert "dl_0" in res.error.message and "after 2 deliveries" in res.error.message
    # The client waiting on it gets that status and OpenAI's error body.
    assert res.status == 503 and json.loads(res.text())["error"]["code"] == 503

    engine = open_database(f"sqlite:///{tmp_path / 'loopline.db'}")
    try:

        def letter():
            with Session(engine) as s:
                return s.get(DeadLetterRow, "dl_0")

        row = await eventually(letter)
        assert (row.stream_seq, row.deliveries) == (seq, 2)
        assert json.loads(row.payload)["request_id"] == "dl_0"

        # The message is gone from WORK rather than retained until max-age.
        async def deleted() -> bool:
            try:
                await js.get_msg(subjects.WORK_STREAM, seq)
                return False
            except NotFoundError:
                return True

        await eventually(deleted)

        # The ledger sees the failure like any other result.
        def status():
            with Session(engine) as s:
                r = s.get(RequestRow, "dl_0")
                return r and r.status

        assert await eventually(lambda: status() == "failed")

        # The same advisory again changes nothing: no second result, still one dead letter.
        results_before = (await js.stream_info(subjects.RESULTS_STREAM)).state.messages
        advisory = {
            "type": "io.nats.jetstream.advisory.v1.max_deliver",
            "stream": subjects.WORK_STREAM,
            "consumer": subjects.inference_durable("flaky"),
            "stream_seq": seq,
            "deliveries": 2,
        }
        await nc.publish(
            subjects.max_deliveries_advisory(subjects.WORK_STREAM, subjects.inference_durable("flaky")),
            json.dumps(advisory).encode(),
        )
        await nc.flush()
        await asyncio.sleep(0.5)
        assert (await js.stream_info(subjects.RESULTS_STREAM)).state.messages == results_before
        with Session(engine) as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(DeadLetterRow)) == 1
    finally:
        engine.dispose()

    # The replica's late answer is deduplicated against the failure: the client keeps one answer.
    late = ResultItem(request_id="dl_0", group="dl", index=0, model="m",
                      body=json.dumps({"choices": [{"index": 0, "text": "late"}]}))
    ack = await js.publish(
        subjects.result("dl", 0), late.model_dump_json().encode(), headers={"Nats-Msg-Id": "dl_0"}
    )
    assert ack.duplicate
    assert (await failure()).error is not None
    with pytest.raises(NotFoundError):
        await js.get_msg(subjects.WORK_STREAM, seq)


async def test_dead_letter_announced_while_the_queue_is_down_is_handled_later(js, start_queue, eventually):
    await bus.ensure_topology(js)
    await bus.ensure_work_consumer(js, "down", ack_wait_s=1, max_deliver=1)
    item = WorkItem(request_id="dd_0", group="dd", index=0, model="m", route="/v1/completions",
                    body=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}))
    await bus.publish_durable(js, subjects.work("down"), item.model_dump_json().encode(), msg_id="dd_0")
    replica = await js.pull_subscribe_bind(subjects.inference_durable("down"), subjects.WORK_STREAM)
    await replica.fetch(1, timeout=2)  # taken and never answered

    async def advisory_stored() -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await replica.fetch(1, timeout=0.3)  # pulling is what makes JetStream notice
        return (await js.stream_info(subjects.ADVISORIES_STREAM)).state.messages == 1

    await eventually(advisory_stored, timeout_s=10)
    await start_queue()

    async def failed() -> bool:
        try:
            raw = await js.get_last_msg(subjects.RESULTS_STREAM, subjects.result("dd", 0))
        except NotFoundError:
            return False
        return ResultItem.model_validate_json(raw.data).error.status == 503

    await eventually(failed, timeout_s=10)
