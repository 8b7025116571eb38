"""A deployment nobody serves any more: the stack restarted with another model on the same state
directory. The old model's MODELS entry outlives its replicas; /v1/models must not list it, a new
request for it must get 503 with Retry-After at once (it used to be queued and wait until the client
gave up), and what was queued for it before must stay queued, polled as ``null``, until a replica of
it comes back and serves it."""

from __future__ import annotations

import time

import httpx
import pytest
from e2e.test_resilience import results_until_done

from loopline.common.local import launcher
from loopline.common.local.stack import plan_deployments
from support.stacks import make_stack

pytestmark = pytest.mark.timeout(900)

OLD, NEW = "tiny", "tiny-embed"
GRACE_S = 8.0
# The grace period is short for the test; ScalarLM's long poll answers null after a second.
ENV = {"LOOPLINE_REPLICA_GRACE_S": str(GRACE_S), "LOOPLINE_RESPONSE_TIMEOUT_S": "1"}
# Nothing trains the embedding model: no adapters (test_deployments.py says why).
NEW_ENV = {**ENV, "LOOPLINE_ADAPTERS__TINY_EMBED": "false"}


def listed(url: str) -> list[str]:
    resp = httpx.get(f"{url}/v1/models", timeout=30)
    assert resp.status_code == 200, resp.text
    return [m["id"] for m in resp.json()["data"]]


def test_restarting_with_another_model_refuses_the_old_one_and_keeps_its_queue(tmp_path, tiny):
    state = tmp_path / "state"
    # 1. The first stack serves OLD; its replica dies, and a ScalarLM batch is accepted within the
    # grace period: queued for a replica that is not there.
    with make_stack(state, OLD, **ENV) as first:
        launcher.kill(first.inference["r0"])
        resp = httpx.post(f"{first.url}/v1/generate", json={"prompts": ["Hello", "World"], "max_tokens": 4},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        ids = [r["request_id"] for r in resp.json()["results"]]
        assert [r["response"] for r in resp.json()["results"]] == [None, None]

    # 2. Restarted with another model on the same state directory.
    with make_stack(state, NEW, **NEW_ENV) as second:
        assert listed(second.url) == [NEW]
        time.sleep(GRACE_S)  # this gateway has not seen OLD served for longer than the grace period
        started = time.monotonic()
        refused = httpx.post(f"{second.url}/v1/completions", timeout=60,
                             json={"model": OLD, "prompt": "Hello", "max_tokens": 4})
        assert time.monotonic() - started < 5, "answered at once, not after waiting for a replica"
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        assert OLD in refused.json()["error"]["message"] and NEW in refused.json()["error"]["message"]
        # The batch queued for OLD is still there: polls answer null, not an error.
        polled = httpx.post(f"{second.url}/v1/generate/get_results", json={"request_ids": ids}, timeout=60)
        assert polled.status_code == 200, polled.text
        assert [r["response"] for r in polled.json()["results"]] == [None, None]

        # 3. A replica of OLD comes back: it serves what was queued, and OLD is listed and served again.
        second.start_replica("old-r0", plan_deployments(OLD, 1, {})[0])
        answered = results_until_done(second.url, ids, deadline_s=300)
        assert all(isinstance(r["response"], str) and not r["error"] for r in answered), answered
        deadline = time.monotonic() + 30
        while sorted(listed(second.url)) != sorted([OLD, NEW]):
            assert time.monotonic() < deadline, listed(second.url)
            time.sleep(0.5)
        served = httpx.post(f"{second.url}/v1/completions", timeout=120,
                            json={"model": OLD, "prompt": "Hello", "max_tokens": 4})
        assert served.status_code == 200, served.text
