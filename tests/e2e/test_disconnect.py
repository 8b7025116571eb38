"""A client that goes away mid-stream stops the generation, as with `vllm serve`: the gateway
publishes ``cancel.<request_id>``, the replica tells vLLM's app its client disconnected, and vLLM
aborts the request instead of generating to ``max_tokens``.

Real parts: the shared stack (nats-server, gateway, queue, the inference replica on the tiny model).
"""

from __future__ import annotations

import json
import time

import httpx

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem
from support.bus_view import BusView

# Long enough that generating it to the end takes several seconds on the tiny model (~300 tokens/s
# for one request on 2 cores), so a replica still busy 3 s after the disconnect did not abort it.
MAX_TOKENS = 2000


def _in_flight(bus: BusView) -> int:
    async def ask(nc) -> int:
        reply = await nc.request(subjects.SVC_INFERENCE_STATUS, b"", timeout=5)
        return int(json.loads(reply.data)["detail"]["in_flight"])

    return bus.ask(ask)


def _last_result(bus: BusView) -> ResultItem:
    async def ask(nc) -> ResultItem:
        msg = await nc.jetstream().get_last_msg(subjects.RESULTS_STREAM, "results.>")
        return ResultItem.model_validate_json(msg.data)

    return bus.ask(ask)


def test_a_stream_whose_client_left_is_aborted(stack):
    bus = BusView(stack.nats_url, "disconnect-test")
    assert _in_flight(bus) == 0
    body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=stack.url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    # The connection is closed here, with ~1997 tokens still to go.
    deadline = time.monotonic() + 30.0
    while _in_flight(bus) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(bus) == 0
    # The stored transcript is the record of what vLLM generated before it stopped.
    result = _last_result(bus)
    assert result.streamed and result.status == 200
    generated = len(result.events())
    assert generated < MAX_TOKENS // 2, f"{generated} events: vLLM went on for a client that left"
