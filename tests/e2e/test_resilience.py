"""Failures in the middle of work: a replica killed with SIGKILL, a replica's vLLM engine killed,
nats-server restarted, a full queue. Nothing accepted may be lost, and nothing may be answered twice."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import nats
import psutil
import pytest

from loopline.common.contracts import subjects
from loopline.common.local import launcher
from loopline.common.local.restarts import ReplicaRestarts
from loopline.common.local.stack import LocalStack
from support import chaos
from support.stacks import make_stack

REPLICAS = ("r0", "r1")


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory, tiny):
    """Two replicas of the tiny model, shared by the tests that kill one (each first brings back
    what an earlier test killed). A one-second poll window: /v1/generate returns while the batch is
    still running."""
    with make_stack(tmp_path_factory.mktemp("two-replicas"), tiny, replicas=2,
                    LOOPLINE_RESPONSE_TIMEOUT_S="1", LOOPLINE_MAX_INFLIGHT="16") as stack:
        yield stack


def serving_replicas(url: str) -> set[str]:
    """The replicas /v1/health lists as answering (their ``replica`` service metadata)."""
    resp = httpx.get(f"{url}/v1/health", timeout=10)
    assert resp.status_code == 200, resp.text
    return {i.get("replica") for i in resp.json()["services"]["vllm"]}


def both_serving(stack: LocalStack, within_s: float = 180) -> None:
    for name in REPLICAS:
        if not stack.inference[name].alive():
            stack.restart_replica(name, kill=False)
    deadline = time.monotonic() + within_s
    while not set(REPLICAS) <= serving_replicas(stack.url):
        assert time.monotonic() < deadline, "the replicas did not both come back"
        assert not stack.dead(), [(p.name, p.log_tail()) for p in stack.dead()]
        time.sleep(0.2)


def engine_core_of(proc: launcher.Proc) -> psutil.Process:
    """The replica's vLLM engine-core process: the child that runs the model."""
    children = psutil.Process(proc.pid).children(recursive=True)
    cores = [c for c in children if "EngineCore" in c.name() + " ".join(c.cmdline())]
    assert len(cores) == 1, [(c.pid, c.name(), c.cmdline()) for c in children]
    return cores[0]


async def served_by(nats_url: str, group: str, count: int) -> dict[str, str]:
    """request id -> the replica whose result RESULTS holds, for the ``count`` results of a batch."""
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.jetstream().subscribe(subjects.results_of_group(group), ordered_consumer=True)
        found: dict[str, str] = {}
        while len(found) < count:
            item = json.loads((await sub.next_msg(timeout=10)).data)
            found[item["request_id"]] = item["replica"]
        return found
    finally:
        await nc.close()


def results_until_done(url: str, ids: list[str], deadline_s: float) -> list[dict]:
    """Poll get_results as ScalarLM's client does until every prompt has an answer."""
    return asyncio.run(chaos.results_until_done(url, ids, deadline_s))


def stored_result_counts(nats_url: str, group: str) -> dict[str, int]:
    """How many results RESULTS holds for each request id of the batch."""
    return asyncio.run(chaos.stored_results(nats_url, group))


def submit(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    resp = httpx.post(f"{url}/v1/generate", json={"prompts": prompts, "max_tokens": max_tokens}, timeout=120)
    assert resp.status_code == 200, resp.text
    return [r["request_id"] for r in resp.json()["results"]]


def test_killing_a_replica_mid_batch_loses_nothing(two_replicas):
    stack = two_replicas
    both_serving(stack)
    prompts = [f"Request {i} of the kill test:" for i in range(100)]
    # Long enough that the batch (~4 waves of 32 on the two replicas) takes seconds: with 48
    # tokens a wave took ~0.3 s, and the batch could finish between two looks at the store.
    ids = submit(stack.url, prompts, max_tokens=256)
    group = ids[0].rsplit("_", 1)[0]
    # Wait until both replicas are busy, then kill one while it holds unfinished work.
    deadline = time.monotonic() + 120
    while len(stored_result_counts(stack.nats_url, group)) < 10:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(stored_result_counts(stack.nats_url, group)) < 100, "batch finished before the kill"
    launcher.kill(stack.inference["r0"])

    results = results_until_done(stack.url, ids, deadline_s=240)
    assert all(r["error"] is None and isinstance(r["response"], str) for r in results)
    counts = stored_result_counts(stack.nats_url, group)
    assert len(counts) == 100 and set(counts.values()) == {1}  # none answered twice


def test_a_replica_whose_engine_dies_hands_its_work_over_reports_down_and_exits(two_replicas):
    """kill -9 of r0's vLLM engine-core process while it generates: r0 drops out of /v1/health within
    5 s, hands its requests to r1 (each answered once, successfully: none with the engine's death),
    exits 1 by itself, and make up's supervisor starts a fresh r0 that serves."""
    stack = two_replicas
    both_serving(stack)
    replica = stack.inference["r0"]
    engine = engine_core_of(replica)
    ids = submit(stack.url, [f"Request {i} of the engine kill test:" for i in range(40)], max_tokens=256)
    group = ids[0].rsplit("_", 1)[0]
    deadline = time.monotonic() + 120
    while len(stored_result_counts(stack.nats_url, group)) < 4:  # both replicas are generating
        assert time.monotonic() < deadline
        time.sleep(0.1)
    engine.kill()
    killed_at = time.monotonic()
    while "r0" in serving_replicas(stack.url):
        assert time.monotonic() - killed_at < 5, "/v1/health still lists r0 5 s after its engine died"
        time.sleep(0.1)
    results = results_until_done(stack.url, ids, deadline_s=240)
    assert [r["error"] for r in results] == [None] * len(ids)
    assert all(isinstance(r["response"], str) for r in results)
    counts = stored_result_counts(stack.nats_url, group)
    assert len(counts) == len(ids) and set(counts.values()) == {1}  # none answered twice
    assert replica.popen.wait(timeout=60) == 1, replica.log_tail()
    assert "engine died" in replica.log_path.read_text()

    said: list[str] = []
    restarts = ReplicaRestarts(stack, first_s=0.2, report=said.append)
    deadline = time.monotonic() + 10
    while not restarts.restarts:
        assert not restarts.check(), "the supervisor gave up on a process"
        assert time.monotonic() < deadline, said
        time.sleep(0.1)
    assert "replica r0 exited with 1" in said[0] and "replica r0 started again" in said[1], said
    assert stack.inference["r0"] is not replica
    both_serving(stack)
    again = submit(stack.url, [f"After the engine kill {i}:" for i in range(32)], max_tokens=16)
    assert [r["error"] for r in results_until_done(stack.url, again, deadline_s=120)] == [None] * 32
    by = asyncio.run(served_by(stack.nats_url, again[0].rsplit("_", 1)[0], 32))
    assert "r0" in by.values(), by


def test_nats_restart_mid_run_loses_no_accepted_request(tmp_path, tiny):
    with make_stack(tmp_path, tiny, LOOPLINE_RESPONSE_TIMEOUT_S="1", LOOPLINE_MAX_INFLIGHT="8") as stack:
        first = submit(stack.url, [f"Before the restart {i}:" for i in range(40)], max_tokens=32)
        stack.restart_nats()
        # Accepted while NATS was coming back: the gateway retries its publishes.
        second = submit(stack.url, [f"After the restart {i}:" for i in range(20)], max_tokens=8)
        results = results_until_done(stack.url, first + second, deadline_s=240)
        assert all(r["error"] is None and isinstance(r["response"], str) for r in results)
        assert not stack.dead(), [p.name for p in stack.dead()]


def test_full_queue_answers_429_with_retry_after(tmp_path, tiny):
    with make_stack(tmp_path, tiny, LOOPLINE_MAX_QUEUE_DEPTH="4") as stack:
        # Wait for the queue service's first admission snapshot.
        time.sleep(1.0)
        resp = httpx.post(f"{stack.url}/v1/generate", json={"prompts": [f"p{i}" for i in range(10)]},
                          timeout=60)
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1 and "queue" in resp.json()["detail"]
        ok = httpx.post(f"{stack.url}/v1/generate", json={"prompts": ["p0", "p1"], "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200
