"""Every process of the shared stack serves /metrics where its status says, and the inference
replica's includes vLLM's own engine metrics (``vllm:*``, registered by vLLM in the same process)
beside Loopline's; the gateway's own port counts the request by route and status.

Real parts: the shared stack (nats-server, gateway, queue, trainer, checkpoint-watcher, the
inference replica on the tiny model).
"""

from __future__ import annotations

import httpx

from loopline.common.contracts import subjects
from support.bus_view import BusView
from support.scrape import metrics_url, scrape, value

STATUS_SUBJECTS = {
    "gateway": subjects.SVC_GATEWAY_STATUS,
    "queue": subjects.SVC_QUEUE_STATUS,
    "inference": subjects.SVC_INFERENCE_STATUS,
    "trainer": subjects.SVC_TRAINER_STATUS,
    "checkpoint-watcher": subjects.SVC_CHECKPOINT_WATCHER_STATUS,
}


def test_every_service_serves_metrics_and_the_replica_vllms_own(stack):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        prompt_tokens = resp.json()["usage"]["prompt_tokens"]
        gateway_samples = scrape(f"{stack.url}/metrics")
    assert (value(gateway_samples, "loopline_gateway_requests_total", route="/v1/completions",
                  method="POST", status="200") or 0) >= 1

    bus = BusView(stack.nats_url, "metrics-test")
    scraped = {role: scrape(bus.ask(lambda nc, subject=subject: metrics_url(nc, subject)))
               for role, subject in STATUS_SUBJECTS.items()}
    for role, samples in scraped.items():
        assert value(samples, "loopline_service_info", role=role) == 1, role

    replica = scraped["inference"]
    names = {s.name for s in replica}
    assert any(name.startswith("vllm:") for name in names), sorted(names)
    # vLLM counted the request it served (and any earlier test's): its engine metrics are live.
    assert sum(s.value for s in replica if s.name == "vllm:prompt_tokens_total") >= prompt_tokens
    assert any(s.name == "vllm:num_requests_running" for s in replica)
