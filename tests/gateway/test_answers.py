"""The gateway's answers inbox: one subscription delivers each group's results to whoever expects
them, and nothing to anyone else (real nats-server)."""

from __future__ import annotations

import asyncio
import json

import nats

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem
from loopline.gateway.core.answers import Answers
from loopline.gateway.core.submit import request_id
from support.nats import nats_server


def result(group: str, index: int) -> ResultItem:
    return ResultItem(request_id=request_id(group, index), group=group, index=index, model="tiny",
                      body=json.dumps({"choices": [{"index": 0, "text": "hi"}]}), prompt_tokens=1,
                      completion_tokens=1, replica="r1", started_at=0.0)


def test_answers_go_to_the_expecting_group_of_the_right_gateway_only(tmp_path):
    async def scenario():
        with nats_server(tmp_path) as proc:
            url = proc.info["url"]
            nc_a, nc_b, replica = [await nats.connect(url) for _ in range(3)]
            a, b = Answers(nc_a), Answers(nc_b)
            await a.start()
            await b.start()
            got: dict[str, list[int]] = {"g1": [], "g2": [], "b": []}
            to_g1 = a.expect("g1", lambda r: got["g1"].append(r.index))
            to_g2 = a.expect("g2", lambda r: got["g2"].append(r.index))
            b.expect("g1", lambda r: got["b"].append(r.index))  # same group name, other gateway
            assert to_g1 == subjects.answer(a.gateway, "g1") and a.gateway != b.gateway
            await nc_a.flush()
            await nc_b.flush()

            await replica.publish(to_g1, b"not json")  # dropped, and the next ones still arrive
            await replica.publish(to_g1, result("g1", 0).model_dump_json().encode())
            await replica.publish(to_g2, result("g2", 3).model_dump_json().encode())
            await replica.flush()
            await asyncio.sleep(0.3)
            a.forget("g1")
            await replica.publish(to_g1, result("g1", 1).model_dump_json().encode())
            await replica.flush()
            await asyncio.sleep(0.3)
            for nc in (nc_a, nc_b, replica):
                await nc.close()
            return got

    assert asyncio.run(scenario()) == {"g1": [0], "g2": [3], "b": []}
