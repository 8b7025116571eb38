"""Failures in the middle of work: a replica killed with SIGKILL, nats-server restarted, a full queue.
Nothing accepted may be lost, and nothing may be answered twice."""

from __future__ import annotations

import asyncio
import time

import httpx

from loopline.common.local import launcher
from support import chaos
from support.stacks import make_stack


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


def test_killing_a_replica_mid_batch_loses_nothing(tmp_path, tiny):
    # A one-second poll window: /v1/generate returns while the batch is still running.
    with make_stack(tmp_path, tiny, replicas=2, LOOPLINE_RESPONSE_TIMEOUT_S="1",
                    LOOPLINE_MAX_INFLIGHT="16") as stack:
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
