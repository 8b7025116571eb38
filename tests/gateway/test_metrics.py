"""The gateway's metrics, scraped from the real process: ``GET /metrics`` on its HTTP port counts
requests by route template and status with their latency (404s and 401s included), a full queue's
429s are counted where admission refuses them (a real queue service with room for nothing), and
the runtime's own metrics port, found in the gateway's status, serves the same registry."""

from __future__ import annotations

import time

import httpx
import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.local import launcher
from support.gateway_process import start_gateway
from support.scrape import metrics_url, scrape, value

REQUESTS = "loopline_gateway_requests_total"
LATENCY_COUNT = "loopline_gateway_request_seconds_count"
UNKNOWN_JOB = "f" * 64


def requests_counted(samples, route: str, method: str, status: int) -> float:
    return value(samples, REQUESTS, route=route, method=method, status=str(status)) or 0


def test_requests_are_counted_by_route_template_and_status(gateway, http):
    before = scrape(f"{gateway.url}/metrics")
    for _ in range(3):
        assert http.get("/v1/health/keepalive").status_code == 200
    assert http.get(f"/v1/megatron/train/{UNKNOWN_JOB}").status_code == 404  # the trainer's 404
    assert http.get("/no/such/route").status_code == 404
    assert http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"}).status_code == 404
    after = scrape(f"{gateway.url}/metrics")

    def added(route: str, method: str, status: int) -> float:
        was = requests_counted(before, route, method, status)
        return requests_counted(after, route, method, status) - was

    assert added("/v1/health/keepalive", "GET", 200) == 3
    assert added("/v1/megatron/train/{job}", "GET", 404) == 1
    assert added("unmatched", "GET", 404) == 1
    assert added("/v1/completions", "POST", 404) == 1
    # The latency histogram saw each of them; the first scrape itself is counted too.
    assert value(after, LATENCY_COUNT, route="/v1/health/keepalive", method="GET") >= 3
    assert value(after, REQUESTS, route="/metrics", method="GET", status="200") >= 1
    # Route templates, never raw paths: the job hash is in no label.
    assert not [s for s in after if UNKNOWN_JOB in str(s.labels) or "/no/such" in str(s.labels)]


def test_the_runtime_port_serves_the_same_registry(gateway, http, nats_bus):
    assert http.get("/v1/health/keepalive").status_code == 200
    samples = scrape(nats_bus.ask(lambda nc: metrics_url(nc, subjects.SVC_GATEWAY_STATUS)))
    assert value(samples, "loopline_service_info", role="gateway") == 1
    assert requests_counted(samples, "/v1/health/keepalive", "GET", 200) >= 1
    # And /v1/health lists where each instance serves its metrics.
    [instance] = http.get("/v1/health").json()["services"]["gateway"]
    assert instance["metrics"].endswith("/metrics")


def test_a_401_before_routing_is_labelled_with_its_route(nats_proc, tmp_path):
    gw = start_gateway(nats_proc.info["url"], tmp_path, LOOPLINE_API_KEYS="sesame")
    try:
        assert httpx.get(f"{gw.url}/v1/megatron/train/{UNKNOWN_JOB}").status_code == 401
        samples = scrape(f"{gw.url}/metrics")  # /metrics is outside /v1: open, as vllm serve's
        assert requests_counted(samples, "/v1/megatron/train/{job}", "GET", 401) == 1
    finally:
        launcher.stop(gw.proc)


@pytest.fixture
def full_queue(nats_proc, nats_bus, tmp_path):
    """A real queue service admitting nothing (max depth 0), and a deployment it reports on."""
    env = {"LOOPLINE_NATS_URL": nats_proc.info["url"], "LOOPLINE_STATE_DIR": str(tmp_path),
           "LOOPLINE_MAX_QUEUE_DEPTH": "0", "LOOPLINE_STATE_INTERVAL_S": "0.1"}
    proc = launcher.start_service("queue", env, tmp_path / "queue.log")
    info = DeploymentInfo(model="metrics-model", deployment="metrics-dep", max_model_len=128, engine="vllm")

    async def deploy(nc) -> None:
        models = await nc.jetstream().key_value(subjects.MODELS_BUCKET)
        await models.put(info.deployment, info.model_dump_json().encode())

    nats_bus.ask(deploy)
    try:
        deadline = time.monotonic() + 30
        # Invariant: the queue is starting or has not yet published a state naming the deployment.
        while True:
            assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
            try:
                samples = scrape(nats_bus.ask(lambda nc: metrics_url(nc, subjects.SVC_QUEUE_STATUS)))
                if value(samples, "loopline_queue_full", deployment=info.deployment) == 1:
                    break
            except Exception:  # noqa: BLE001 - not answering yet
                pass
            time.sleep(0.1)
        time.sleep(0.3)  # a few more states published: the gateway has heard one of them
        yield info
    finally:
        launcher.stop(proc)

        async def undeploy(nc) -> None:
            await (await nc.jetstream().key_value(subjects.MODELS_BUCKET)).purge(info.deployment)

        nats_bus.ask(undeploy)


def test_a_full_queue_429_is_counted_by_route_and_deployment(gateway, http, full_queue):
    resp = http.post("/v1/completions", json={"model": full_queue.model, "prompt": "hi", "max_tokens": 1},
                     timeout=10)
    assert resp.status_code == 429, resp.text
    samples = scrape(f"{gateway.url}/metrics")
    assert requests_counted(samples, "/v1/completions", "POST", 429) == 1
    assert value(samples, "loopline_gateway_admission_rejections_total",
                 deployment=full_queue.deployment) == 1
