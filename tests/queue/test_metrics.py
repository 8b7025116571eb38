"""The queue service's /metrics, scraped from the real process: each deployment's depth and
in-flight requests from the admission state it publishes, the admission limit, and the ledger's
rows by feed and outcome."""

from __future__ import annotations

import json

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo, ResultItem, WorkItem
from loopline.common.runtime import bus
from support.scrape import metrics_url, scrape, value


def work(index: int) -> WorkItem:
    return WorkItem(request_id=f"mg_{index}", group="mg", index=index, model="m", route="/v1/completions",
                    body=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}))


async def test_depth_admission_and_ledger_rows(nc, js, start_queue, eventually):
    await start_queue(MAX_QUEUE_DEPTH="3")
    # What an inference replica does when it starts: describe the model, create the consumer.
    models = await js.key_value(subjects.MODELS_BUCKET)
    info = DeploymentInfo(model="m", deployment="dep", max_model_len=128, engine="vllm")
    await models.put("dep", info.model_dump_json().encode())
    await bus.ensure_work_consumer(js, "dep", ack_wait_s=30, max_deliver=5)

    items = [work(i) for i in range(3)]
    for item in items:
        await bus.publish_durable(js, subjects.work("dep"), item.model_dump_json().encode(),
                                  msg_id=item.request_id)
    # A replica takes one (in flight, not acked) and answers another one's result.
    replica = await js.pull_subscribe_bind(subjects.inference_durable("dep"), subjects.WORK_STREAM)
    [taken] = await replica.fetch(1, timeout=2)
    answer = ResultItem(request_id="mg_0", group="mg", index=0, model="m", body="{}")
    await bus.publish_durable(js, subjects.result("mg", 0), answer.model_dump_json().encode(), msg_id="r0")
    # Not a result: the ledger drops it, and counts it.
    await bus.publish_durable(js, subjects.result("mg", 9), b"not json", msg_id="r9")

    url = await metrics_url(nc, subjects.SVC_QUEUE_STATUS)

    def settled():
        samples = scrape(url)
        rows = {(feed, outcome): value(samples, "loopline_queue_ledger_rows_total", feed=feed,
                                       outcome=outcome)
                for feed, outcome in (("work", "written"), ("results", "written"), ("results", "unparsable"))}
        depth = value(samples, "loopline_queue_depth", deployment="dep")
        if rows == {("work", "written"): 3, ("results", "written"): 1, ("results", "unparsable"): 1} \
                and depth == 3:
            return samples
        return None

    samples = await eventually(settled)
    assert value(samples, "loopline_queue_in_flight", deployment="dep") == 1
    assert value(samples, "loopline_queue_max_depth") == 3
    # At the limit: the gateways answer this deployment's requests 429.
    assert value(samples, "loopline_queue_full", deployment="dep") == 1
    assert value(samples, "loopline_queue_state_timestamp_seconds") > 0
    assert value(samples, "loopline_service_info", role="queue") == 1
    await taken.ack()
