"""End to end: the queue service publishes each deployment's depth on queue.state."""

from __future__ import annotations

import json

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo, QueueState, WorkItem
from loopline.common.runtime import bus


async def test_queue_state_reports_pending_and_in_flight(nc, js, start_queue, eventually):
    await start_queue(max_queue_depth="77")

    models = await js.key_value(subjects.MODELS_BUCKET)
    for dep in ("busy", "idle"):
        info = DeploymentInfo(model=f"model-{dep}", deployment=dep, max_model_len=256, engine="vllm")
        await models.put(dep, info.model_dump_json().encode())
    # Only "busy" has a replica (hence a work consumer); "idle" must still be reported, as empty.
    await bus.ensure_work_consumer(js, "busy", ack_wait_s=30, max_deliver=5)

    states: list[QueueState] = []

    async def collect(msg):
        states.append(QueueState.model_validate_json(msg.data))

    await nc.subscribe(subjects.QUEUE_STATE, cb=collect)

    for i in range(5):
        item = WorkItem(
            request_id=f"g_{i}",
            group="g",
            index=i,
            model="model-busy",
            route="/v1/completions",
            body=json.dumps({"model": "model-busy", "prompt": "hi", "max_tokens": 2}),
        )
        await bus.publish_durable(
            js, subjects.work("busy"), item.model_dump_json().encode(), msg_id=item.request_id
        )

    def latest_has(pending: int, in_flight: int) -> QueueState | None:
        if not states:
            return None
        state = states[-1]
        load = state.deployments.get("busy")
        return state if load and (load.pending, load.in_flight) == (pending, in_flight) else None

    state = await eventually(lambda: latest_has(5, 0))
    assert state.max_depth == 77
    assert set(state.deployments) == {"busy", "idle"}
    assert state.deployments["idle"].depth == 0

    # A replica takes two without acking yet: they move from pending to in flight.
    sub = await js.pull_subscribe_bind(subjects.inference_durable("busy"), subjects.WORK_STREAM)
    taken = await sub.fetch(2, timeout=2)
    assert len(taken) == 2
    await eventually(lambda: latest_has(3, 2))

    # A deployment removed from the bucket drops out of the state.
    await models.delete("idle")
    await eventually(lambda: states and "idle" not in states[-1].deployments)
