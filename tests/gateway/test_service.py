"""The gateway process under the shared runtime (real nats-server, the gateway as its own process):
it reports as ``loopline-gateway``, stops cleanly on SIGTERM after finishing the requests in
flight, and a port it cannot listen on fails its start with exit 1."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import httpx
import nats

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ServiceStatus
from loopline.common.local import launcher
from support.gateway_process import BASE_MODEL, start_gateway


def _ask(url: str, subject: str) -> bytes:
    async def ask() -> bytes:
        nc = await nats.connect(url)
        try:
            return (await nc.request(subject, b"{}", timeout=5)).data
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_queue_routes_without_a_queue_service_are_503_saying_so(http):
    # These tests run no queue service: its routes say that, in the shape of every other error.
    for method, path in (("GET", "/v1/generate/metrics"), ("POST", "/v1/generate/clear_queue")):
        resp = http.request(method, path)
        assert resp.status_code == 503, resp.text
        assert "queue service is not running" in resp.json()["detail"]
        assert resp.headers["Retry-After"] == "5"


def test_status_over_nats_and_on_the_health_page(gateway, nats_proc, http):
    status = ServiceStatus.model_validate_json(_ask(nats_proc.info["url"], subjects.SVC_GATEWAY_STATUS))
    assert status.service == "gateway"
    assert status.detail["models"] == []  # no inference replica in these tests
    assert status.detail["adapters_deployed"] == 0
    answers = status.detail["answers"]
    assert len(answers) == 16

    health = http.get("/v1/health").json()
    assert health["gateway"] == "up"
    [instance] = health["services"]["gateway"]
    assert instance["answers"] == answers and instance["http"].endswith(gateway.url.rsplit(":", 1)[1])
    assert health["all"] == "down"  # neither a replica nor the queue runs here


def test_sigterm_finishes_the_request_in_flight_then_exits_0(nats_proc, tmp_path):
    gw = start_gateway(nats_proc.info["url"], tmp_path)
    answered: list[int] = []
    try:
        # /v1/health listens 0.25 s for the services' PING replies: still running when SIGTERM comes.
        request = threading.Thread(
            target=lambda: answered.append(httpx.get(f"{gw.url}/v1/health", timeout=10).status_code))
        request.start()
        time.sleep(0.1)
        gw.proc.popen.send_signal(signal.SIGTERM)
        request.join(timeout=10)
        assert gw.proc.popen.wait(timeout=20) == 0, gw.proc.log_tail()
    finally:
        launcher.stop(gw.proc)
    assert answered == [200]
    assert "stopped (exit 0)" in gw.proc.log_tail()


def test_a_taken_port_fails_the_start_with_exit_1(nats_proc, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {"LOOPLINE_NATS_URL": nats_proc.info["url"], "LOOPLINE_STATE_DIR": str(tmp_path),
               "LOOPLINE_PORT": str(taken.getsockname()[1]), "LOOPLINE_MODEL": BASE_MODEL}
        proc = launcher.start_service("gateway", env, tmp_path / "gateway.log")
        try:
            assert proc.popen.wait(timeout=30) == 1, proc.log_tail()
        finally:
            launcher.stop(proc)
    assert "HttpServerFailed" in proc.log_tail(80), proc.log_tail(80)
