"""The replica's worker answers a work item's ``reply_to`` at once and keeps the stored result.

Real parts: nats-server, the worker and vLLM's own OpenAI server (in-process, as the replica runs
it) on the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import pytest_asyncio

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem, WorkItem
from loopline.common.runtime import bus
from loopline.gateway.core.submit import request_id
from loopline.gateway.core.work import WorkPublisher
from loopline.inference.vllm_args import serve_flags
from loopline.inference.vllm_server import VllmServer
from loopline.inference.worker import Worker
from support.nats import nats_server
from support.stacks import tiny_model

# Tier: a real vLLM engine per module, 10-20 s to start.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]
DEPLOYMENT = "tiny-answers"
SERVED_NAME = "tiny"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replica(tmp_path_factory):
    with nats_server(tmp_path_factory.mktemp("nats")) as proc:
        nc = await bus.connect(proc.info["url"], "test")
        js = nc.jetstream()
        await bus.ensure_topology(js)
        await bus.ensure_work_consumer(js, DEPLOYMENT, ack_wait_s=30, max_deliver=3)
        server = VllmServer(serve_flags(tiny_model(), served_name=SERVED_NAME, max_inflight=8))
        await server.start()
        worker = Worker(nc, js, server, deployment=DEPLOYMENT, replica="r1", max_inflight=8,
                        ack_wait_s=30, max_deliver=3)
        stopping = asyncio.Event()
        task = asyncio.create_task(worker.run(stopping, drain_s=5))
        yield nc, js, worker
        stopping.set()
        await task
        await server.stop()
        await nc.close()


async def publish(js, group: str, count: int, reply_to: str | None) -> None:
    """Work items as the gateway makes and publishes them (its own request ids and publisher): each
    a vLLM completion request."""
    bodies = [{"model": SERVED_NAME, "prompt": f"Count to {i + 2}:", "max_tokens": 6} for i in range(count)]
    items = [WorkItem(request_id=request_id(group, i), group=group, index=i, model=SERVED_NAME,
                      route="/v1/completions", body=json.dumps(body), reply_to=reply_to)
             for i, body in enumerate(bodies)]
    await WorkPublisher(js, retry_after_s=1).publish(None, items, DEPLOYMENT)


async def test_each_answer_reaches_reply_to_once_and_matches_the_stored_result(replica):
    nc, js, _ = replica
    group = uuid.uuid4().hex
    reply_to = subjects.answer("gw-test", group)
    heard: list[ResultItem] = []
    all_heard = asyncio.Event()

    async def on_answer(msg):
        heard.append(ResultItem.model_validate_json(msg.data))
        if len(heard) == 5:
            all_heard.set()

    sub = await nc.subscribe(subjects.gateway_answers("gw-test"), cb=on_answer)
    # A lone request first, then four together: both ways the worker pulls (with and without
    # others waiting behind the first) must start every item exactly once.
    await publish(js, group, 1, reply_to)
    await asyncio.sleep(1.0)
    four = uuid.uuid4().hex
    await publish(js, four, 4, subjects.answer("gw-test", four))
    await asyncio.wait_for(all_heard.wait(), 120)
    await asyncio.sleep(0.5)  # a duplicate would arrive meanwhile
    await sub.unsubscribe()

    assert sorted((r.group, r.index) for r in heard) == sorted([(group, 0)] + [(four, i) for i in range(4)])
    for answer in heard:
        raw = await js.get_last_msg(subjects.RESULTS_STREAM, subjects.result(answer.group, answer.index))
        stored = ResultItem.model_validate_json(raw.data)
        assert stored == answer
        assert stored.status == 200 and stored.error is None and stored.completion_tokens > 0
        # vLLM's own completion, for the item's own request.
        body = json.loads(stored.text())
        assert body["object"] == "text_completion" and body["model"] == SERVED_NAME
        assert body["usage"]["completion_tokens"] == stored.completion_tokens


async def test_without_reply_to_only_the_stored_result_is_published(replica):
    nc, js, worker = replica
    group = uuid.uuid4().hex
    stray: list[str] = []

    async def on_any(msg):
        stray.append(msg.subject)

    sub = await nc.subscribe(subjects.gateway_answers("*"), cb=on_any)
    served = worker.served
    await publish(js, group, 1, None)
    for _ in range(600):
        if worker.served > served:
            break
        await asyncio.sleep(0.1)
    raw = await js.get_last_msg(subjects.RESULTS_STREAM, subjects.result(group, 0))
    assert ResultItem.model_validate_json(raw.data).request_id == request_id(group, 0)
    await asyncio.sleep(0.2)
    await sub.unsubscribe()
    assert stray == []
