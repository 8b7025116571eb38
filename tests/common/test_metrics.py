"""The shared runtime's ``/metrics`` server in a real process (the probe service of
support/runtime_probe.py): found through the status endpoint, served from start-up to the stop,
answered while the event loop is held, on a fixed port or off, and a taken port fails the start."""

from __future__ import annotations

import re
import signal
import socket

import httpx
import pytest

from loopline.common.local import launcher
from support.scrape import scrape, value


def test_metrics_url_is_in_the_status_and_serves_prometheus_text(probe):
    p = probe("stop", LOOPLINE_REPLICA_ID="probe-3")
    p.wait_log("serving:")
    status, info = p.status()
    url = status.detail["metrics_url"]
    assert url == info["metadata"]["metrics"] and f"metrics at {url}" in p.log
    assert url.startswith(f"http://{socket.gethostname()}:") and url.endswith("/metrics")

    samples = scrape(url)
    # The runtime's own: which service answered; then prometheus_client's process collector.
    assert value(samples, "loopline_service_info", role="probe", replica="probe-3") == 1
    assert value(samples, "process_resident_memory_bytes") > 0

    p.signal(signal.SIGTERM)
    assert p.exit_code() == 0, p.log
    assert "Traceback" not in p.log


def test_a_fixed_port_is_used_and_a_negative_one_turns_metrics_off(probe):
    port = launcher.free_port()
    fixed = probe("stop", LOOPLINE_METRICS_PORT=str(port))
    off = probe("stop", LOOPLINE_METRICS_PORT="-1")
    fixed.wait_log("serving:")
    off.wait_log("serving:")
    assert f"metrics at http://{socket.gethostname()}:{port}/metrics" in fixed.log
    assert scrape(f"http://127.0.0.1:{port}/metrics")
    assert "metrics off" in off.log and "metrics at" not in off.log
    fixed.signal(signal.SIGTERM)
    off.signal(signal.SIGTERM)
    assert (fixed.exit_code(), off.exit_code()) == (0, 0), fixed.log + off.log
    # Stopped with the process: nothing listens there any more.
    try:
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
        raise AssertionError(f"port {port} still answers after the probe exited")
    except httpx.ConnectError:
        pass


def test_off_leaves_no_metrics_url_in_the_status(probe):
    p = probe("stop", LOOPLINE_METRICS_PORT="-1")
    p.wait_log("serving:")
    status, info = p.status()
    assert "metrics_url" not in status.detail and "metrics" not in info["metadata"]
    assert status.detail["scenario"] == "stop"
    p.signal(signal.SIGTERM)
    assert p.exit_code() == 0, p.log


# Tier: holds the event loop for seconds, ~6 s.
@pytest.mark.slow
def test_a_scrape_is_answered_while_the_event_loop_is_held(probe):
    # The server runs on a thread of its own: a loop that blocks the event loop for 5 s (a bug)
    # leaves the process scrapable, which is when an operator most wants to look at it.
    p = probe("block")
    p.wait_log("blocking the event loop")
    [url] = re.findall(r"metrics at (\S+)", p.log)
    samples = scrape(url)
    assert "event loop free again" not in p.log, "the scrape only came back once the loop was free"
    assert value(samples, "loopline_service_info", role="probe") == 1
    p.signal(signal.SIGTERM)
    assert p.exit_code() == 0, p.log


def test_a_taken_port_fails_the_start_with_exit_1(probe):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        p = probe("stop", LOOPLINE_METRICS_PORT=str(taken.getsockname()[1]))
        assert p.exit_code() == 1, p.log
    assert "failed to start" in p.log and "Address already in use" in p.log
    assert "serving:" not in p.log
