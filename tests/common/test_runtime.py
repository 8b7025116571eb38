"""The shared runtime's exit policy and status endpoint, in a real process against a real nats-server:
a probe service (support/runtime_probe.py) whose loops end on the stop, raise, return early or
ignore the stop, and whose start-up fails or is interrupted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopline.common import bus
from loopline.common.schemas import ServiceStatus
from support.runtime_probe import GRACE_S, SERVICE, STATUS_SUBJECT

TESTS = Path(__file__).resolve().parents[1]


class Probe:
    def __init__(self, scenario: str, nats_url: str, log_path: Path, **env: str):
        self.log_path = log_path
        base = {k: v for k, v in os.environ.items() if k != "LOOPLINE_REPLICA_ID"}
        path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "support.runtime_probe", scenario], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**base, "PYTHONPATH": path, "LOOPLINE_NATS_URL": nats_url, **env})

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log:
            assert self.popen.poll() is None, f"exited {self.popen.returncode} before {text!r}:\n{self.log}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{self.log}"
            time.sleep(0.05)

    def exit_code(self, timeout_s: float = 30) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            pytest.fail(f"still running after {timeout_s} s:\n{self.log}")

    def signal(self, signum: int) -> float:
        self.popen.send_signal(signum)
        return time.monotonic()


@pytest.fixture
def probe(nats_url, tmp_path):
    started: list[Probe] = []

    def start(scenario: str, **env: str) -> Probe:
        started.append(Probe(scenario, nats_url, tmp_path / f"probe-{len(started)}.log", **env))
        return started[-1]

    yield start
    for p in started:
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait()


def test_loops_that_end_on_the_stop_exit_0(probe):
    p = probe("stop")
    p.wait_log("serving: loops first, second")
    p.signal(signal.SIGTERM)
    assert p.exit_code() == 0, p.log
    log = p.log
    assert "first saw the stop" in log and "second saw the stop" in log
    assert "probe: cleanup ran" in log and "stopped (exit 0)" in log and "Traceback" not in log


def test_a_loop_that_raises_ends_the_process_with_1_and_its_traceback(probe):
    p = probe("raise")
    assert p.exit_code() == 1, p.log
    log = p.log
    assert "loop doomed died" in log
    assert "Traceback" in log and "RuntimeError: doomed loop failed" in log
    assert "steady saw the stop" in log, "the other loop was not stopped"
    assert "probe: cleanup ran" in log


def test_a_loop_that_returns_before_the_stop_has_died(probe):
    p = probe("return")
    assert p.exit_code() == 1, p.log
    log = p.log
    assert "loop quitter died" in log and "returned before the service was told to stop" in log
    assert "steady saw the stop" in log


def test_a_loop_that_raises_while_stopping_exits_1(probe):
    p = probe("raise-on-stop")
    p.wait_log("serving:")
    p.signal(signal.SIGTERM)
    assert p.exit_code() == 1, p.log
    assert "loop clumsy died" in p.log and "RuntimeError: failed while stopping" in p.log


def test_a_loop_that_ignores_the_stop_is_cancelled_after_the_grace(probe):
    p = probe("ignore")
    p.wait_log("serving:")
    signalled = p.signal(signal.SIGTERM)
    code = p.exit_code()
    took = time.monotonic() - signalled
    log = p.log
    assert "loop stubborn did not stop within" in log and "stubborn cancelled (stopping True)" in log
    assert "steady saw the stop" in log and "probe: cleanup ran" in log
    # Cancelled once the grace ran out, not left running: the stop was asked for, so exit 0.
    assert code == 0, log
    assert GRACE_S <= took < GRACE_S + 5, took


def test_a_second_interrupt_exits_at_once(probe):
    p = probe("ignore")
    p.wait_log("serving:")
    p.signal(signal.SIGINT)
    p.wait_log("SIGINT received")
    p.signal(signal.SIGINT)
    assert p.exit_code() == 130, p.log


def test_start_up_that_raises_exits_1_after_the_cleanups(probe):
    p = probe("start-fails")
    assert p.exit_code() == 1, p.log
    log = p.log
    assert "failed to start" in log and "ValueError: start-up failed on purpose" in log
    assert "probe: cleanup ran" in log and "serving:" not in log


def test_a_signal_during_start_up_stops_it_at_once_with_0(probe):
    p = probe("slow-start")
    p.wait_log("loading for a minute")
    signalled = p.signal(signal.SIGTERM)
    assert p.exit_code(timeout_s=30) == 0, p.log
    took = time.monotonic() - signalled
    log = p.log
    assert took < 5, f"{took:.1f} s: start-up was not cancelled"
    assert "stopped during start-up" in log and "probe: loaded" not in log
    assert "probe: cleanup ran" in log and "Traceback" not in log


async def ask_status(nats_url: str) -> tuple[ServiceStatus, dict]:
    nc = await bus.connect(nats_url, "runtime-test")
    try:
        status = ServiceStatus.model_validate_json((await nc.request(STATUS_SUBJECT, b"{}", timeout=5)).data)
        info = json.loads((await nc.request(f"$SRV.INFO.{SERVICE}", b"", timeout=5)).data)
        return status, info
    finally:
        await nc.close()


@pytest.mark.parametrize("replica_id", ["probe-7", None])
def test_status_answers_with_the_replica_id(probe, nats_url, replica_id):
    env = {"LOOPLINE_REPLICA_ID": replica_id} if replica_id else {}
    p = probe("stop", **env)
    p.wait_log("serving:")
    status, info = asyncio.run(ask_status(nats_url))
    expected = replica_id or f"{socket.gethostname()}-{p.popen.pid}"
    assert status.service == "probe" and status.replica == expected
    assert status.detail == {"scenario": "stop"}
    assert info["name"] == SERVICE and info["metadata"]["replica"] == expected
    assert any(e["subject"] == STATUS_SUBJECT for e in info["endpoints"])
    p.signal(signal.SIGTERM)
    assert p.exit_code() == 0, p.log
