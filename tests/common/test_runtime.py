"""The shared runtime's exit policy and status endpoint, in a real process against a real nats-server:
a probe service (support/runtime_probe.py) whose loops end on the stop, raise, return early or
ignore the stop, and whose start-up fails or is interrupted."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from support.runtime_probe import GRACE_S, SERVICE, STATUS_SUBJECT


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


def test_start_up_that_refuses_exits_2_with_its_message_alone(probe):
    p = probe("start-refused")
    assert p.exit_code() == 2, p.log
    log = p.log
    assert "refuses to start: found engine 9.9, tested with 1.0 only: install 1.0; exiting 2" in log
    assert "Traceback" not in log and "failed to start" not in log
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


@pytest.mark.parametrize("replica_id", ["probe-7", None])
def test_status_answers_with_the_replica_id(probe, replica_id):
    env = {"LOOPLINE_REPLICA_ID": replica_id} if replica_id else {}
    p = probe("stop", **env)
    p.wait_log("serving:")
    status, info = p.status()
    expected = replica_id or f"{socket.gethostname()}-{p.popen.pid}"
    assert status.service == "probe" and status.replica == expected
    assert status.detail["scenario"] == "stop"
    assert info["name"] == SERVICE and info["metadata"]["replica"] == expected
    assert any(e["subject"] == STATUS_SUBJECT for e in info["endpoints"])
    p.signal(signal.SIGTERM)
    assert p.exit_code() == 0, p.log
