"""How each service process ends, started as the stack starts it, against a real nats-server.

A loop that dies ends the process: each service's main loop is made to raise from inside
(support/kill_loop.py runs the service's real ``main()``), and the process must exit by itself,
non-zero, with the traceback in its log, so that its supervisor restarts it. A SIGTERM still ends
it cleanly with 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem, ServiceStatus, WorkItem
from loopline.common.local import launcher
from loopline.common.runtime import bus, service as runtime
from loopline.gateway.core.submit import Prompt, request_id
from loopline.gateway.core.work import WorkPublisher
from support.kill_loop import KILLED
from support.stacks import MODELS_DIR, tiny_model

TESTS = Path(__file__).resolve().parents[1]
# The loop dies this long after the service starts serving: long enough for the test to see it
# answer its status first (the status endpoint is up before the loops start).
AFTER_S = 3.0
# From the moment it answered: AFTER_S, the other loops finishing their step, the cleanups. The
# runtime gives loops 10 s at most; a service that needs more than this is hanging, not stopping.
EXIT_WITHIN_S = AFTER_S + runtime.GRACE_S + 15
READY_WITHIN_S = 180  # the inference replica loads the tiny model first


@dataclass(frozen=True)
class Service:
    name: str  # as launcher.SERVICE_MODULES names it
    main_loop: str
    status_subject: str

    @property
    def package(self) -> str:
        return launcher.SERVICE_MODULES[self.name]


SERVICES = [
    Service("queue", "ledger-work", subjects.SVC_QUEUE_STATUS),
    Service("trainer", "reconcile", subjects.SVC_TRAINER_STATUS),
    Service("checkpoint-watcher", "scan", subjects.SVC_CHECKPOINT_WATCHER_STATUS),
    Service("inference", "worker", subjects.SVC_INFERENCE_STATUS),
    Service("gateway", "http", subjects.SVC_GATEWAY_STATUS),
]


# Loops beside the main ones whose death a replica would otherwise hide: a replica whose adapter
# loader died goes on answering with old versions; a gateway whose model refresh died goes on
# routing to models that left.
SIDE_LOOPS = [
    dataclasses.replace(next(s for s in SERVICES if s.name == "inference"), main_loop="adapter-loads"),
    dataclasses.replace(next(s for s in SERVICES if s.name == "gateway"), main_loop="models"),
]


@pytest.fixture(params=SERVICES, ids=lambda s: s.name)
def service(request) -> Service:
    return request.param


@pytest.fixture
def env(nats_url, tmp_path, service) -> dict[str, str]:
    return service_env(nats_url, tmp_path, service.name)


def service_env(nats_url: str, tmp_path: Path, name: str) -> dict[str, str]:
    """What the stack gives every service (stack.py's env), on a state directory of its own."""
    return {
        "LOOPLINE_NATS_URL": nats_url,
        "LOOPLINE_STATE_DIR": str(tmp_path / "state"),
        "LOOPLINE_MODELS_DIR": str(MODELS_DIR),
        "LOOPLINE_MODEL": tiny_model(),
        "LOOPLINE_LAUNCHER": "local",
        "LOOPLINE_HOST": "127.0.0.1",
        "LOOPLINE_PORT": str(launcher.free_port()),
        "LOOPLINE_LOG_LEVEL": "INFO",
        "LOOPLINE_REPLICA_ID": f"{name}-under-test",
    }


def wait_serving(proc: launcher.Proc, service: Service, env: dict[str, str]) -> None:
    """Until the process answers its status as the replica it was told to be."""

    async def ask() -> None:
        nc = await bus.connect(env["LOOPLINE_NATS_URL"], "service-exit-test")
        try:
            await status_of(nc, proc, service, env)
        finally:
            await nc.close()

    asyncio.run(ask())


async def status_of(nc, proc: launcher.Proc, service: Service, env: dict[str, str],
                    within_s: float = READY_WITHIN_S) -> ServiceStatus:
    """The process's status once it answers, as the replica it was told to be."""
    deadline = time.monotonic() + within_s
    while True:
        assert proc.alive(), f"{service.name} exited {proc.popen.returncode}:\n{proc.log_tail(80)}"
        assert time.monotonic() < deadline, f"{service.name} never answered:\n{proc.log_tail()}"
        try:
            reply = await nc.request(service.status_subject, b"{}", timeout=0.5)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            await asyncio.sleep(0.1)
            continue
        status = ServiceStatus.model_validate_json(reply.data)
        assert status.replica == env["LOOPLINE_REPLICA_ID"], status
        return status


def exit_code(proc: launcher.Proc, within_s: float) -> int:
    try:
        return proc.popen.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        launcher.kill(proc)
        pytest.fail(f"{proc.name} still running {within_s:.0f} s later:\n{proc.log_tail(80)}")


def start_with_a_dying_loop(service: Service, env: dict[str, str], log_path: Path) -> launcher.Proc:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "support.kill_loop", service.package, service.main_loop, str(AFTER_S)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **env, "PYTHONPATH": path})
    return launcher.Proc(service.name, popen, log_path)


def test_a_service_whose_main_loop_dies_exits_non_zero_by_itself(service, env, tmp_path):
    proc = start_with_a_dying_loop(service, env, tmp_path / "logs" / f"{service.name}.log")
    try:
        wait_serving(proc, service, env)
        code = exit_code(proc, EXIT_WITHIN_S)
    finally:
        launcher.kill(proc)
    log = proc.log_path.read_text(errors="replace")
    assert code == runtime.EXIT_LOOP_DIED != 0, log
    assert "serving: loops" in log and f"loop {service.main_loop} died" in log, log
    assert "Traceback (most recent call last)" in log and f"RuntimeError: {KILLED}" in log, log


@pytest.mark.parametrize("side", SIDE_LOOPS, ids=lambda s: f"{s.name}-{s.main_loop}")
def test_a_service_whose_other_loop_dies_exits_non_zero_too(side, nats_url, tmp_path):
    env = service_env(nats_url, tmp_path, side.name)
    test_a_service_whose_main_loop_dies_exits_non_zero_by_itself(side, env, tmp_path)


def test_sigterm_stops_a_service_with_0(service, env, tmp_path):
    proc = launcher.start_service(service.name, env, tmp_path / "logs" / f"{service.name}.log")
    try:
        wait_serving(proc, service, env)
        proc.popen.send_signal(signal.SIGTERM)
        code = exit_code(proc, runtime.GRACE_S + 15)
    finally:
        launcher.kill(proc)
    log = proc.log_path.read_text(errors="replace")
    assert code == 0, log
    assert "SIGTERM received" in log and "stopped (exit 0)" in log and "Traceback" not in log, log
    # Every loop let go of its subscriptions: nothing held the final drain up to its timeout.
    assert "draining connection timed out" not in log, log


def test_sigterm_lets_a_replica_finish_the_requests_in_flight(nats_url, tmp_path):
    replica = next(s for s in SERVICES if s.name == "inference")
    env = {**service_env(nats_url, tmp_path, "inference"), "LOOPLINE_SERVED_MODEL_NAME": "tiny",
           "LOOPLINE_MAX_INFLIGHT": "4", "LOOPLINE_ADAPTERS": "false"}
    proc = launcher.start_service("inference", env, tmp_path / "logs" / "inference.log")
    try:
        in_flight, results = asyncio.run(stop_while_generating(proc, replica, env, prompts=12))
        code = exit_code(proc, runtime.GRACE_S + 15)
    finally:
        launcher.kill(proc)
    log = proc.log_path.read_text(errors="replace")
    assert code == 0, log
    assert "finishing" in log and "still in flight after the drain" not in log, log
    # What it held when told to stop was answered; the rest stays in WORK for another replica.
    assert in_flight >= 1 and len(results) >= in_flight, (in_flight, len(results))
    assert all(r.status == 200 and json.loads(r.text())["choices"][0]["text"] for r in results), results


async def stop_while_generating(proc: launcher.Proc, replica: Service, env: dict[str, str],
                                prompts: int) -> tuple[int, list[ResultItem]]:
    """Publish work as the gateway does, SIGTERM the replica once it generates, and collect the
    results stored until it exited: (requests in flight at the signal, results)."""
    nc = await bus.connect(env["LOOPLINE_NATS_URL"], "service-exit-test")
    try:
        await status_of(nc, proc, replica, env)
        js = nc.jetstream()
        group = f"stop{time.monotonic_ns()}"
        requests = [Prompt(text=f"Count slowly from {i} to a hundred:").as_request("tiny", 48, 0.0)
                    for i in range(prompts)]
        items = [WorkItem(request_id=request_id(group, i), group=group, index=i, model="tiny",
                          route=route, body=body)
                 for i, (route, body) in enumerate(requests)]
        await WorkPublisher(js, retry_after_s=1).publish(None, items, subjects.deployment_key("tiny"))
        # Polls the replica's status over NATS: no event in this process to wait on.
        while (in_flight := (await status_of(nc, proc, replica, env, 60)).detail["in_flight"]) < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        proc.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.popen.wait, runtime.GRACE_S + 15)
        sub = await js.subscribe(subjects.results_of_group(group), ordered_consumer=True)
        results = []
        with contextlib.suppress(nats.errors.TimeoutError):
            while True:
                results.append(ResultItem.model_validate_json((await sub.next_msg(timeout=1)).data))
        return in_flight, results
    finally:
        await nc.close()
