"""The dashboard following a whole stack (tiny model, a vLLM replica, the local launcher; the
session's ``tinker_stack``, no keys as ``make up``), in a real headless Chromium: the deployment
and its replica with its engine up; a real LoRA job, submitted by the unmodified ``scalarlm``
client, appearing and gaining loss points on its page while it trains; its adapter shown loaded on
the replica and its checkpoint served by it; an OpenAI request to the job shown with the adapter
version that answered it; a Tinker training run's steps, loss, learning rate and the reward its
client posts (``POST /v1/tinker/runs/{run}/metrics``) on the run's page.

Screenshots go to ``.loopline/screenshots/`` (git-ignored): the overview and the run's page.
"""

from __future__ import annotations

import httpx
import pytest
import scalarlm
from e2e.test_adapter_serving import PAIRS, complete, wait_for
from tinker import types

from support.browser import SCREENSHOTS as SHOTS, Browser, require_chromium
from support.tinker_data import token_rows_data

# Long enough that the page sees it train (the tiny model takes a few milliseconds a step).
RECIPE = {"max_steps": 150, "learning_rate": 1e-3, "batch_size": 3, "gradient_accumulation_steps": 1,
          "steps_per_checkpoint": 75, "adapter_type": "lora"}
LAST = str(RECIPE["max_steps"])
REWARD = "env/all/reward/total"
# The loss chart's point count, as a page shows it.
POINTS = "+(document.querySelector('#job-loss svg')?.dataset.points ?? 0)"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    require_chromium()
    with Browser(tmp_path_factory.mktemp("chromium")) as b:
        yield b


def test_a_job_and_a_tinker_run_on_the_dashboard_of_a_whole_stack(tinker_stack, service, tiny, browser,
                                                                    tmp_path, monkeypatch):
    page = browser.page()
    page.viewport(1280, 800)
    page.open(f"{tinker_stack.url}/ui")
    # The deployment, its replica and the replica's engine, from the replica's own status.
    page.wait_for("[...document.querySelectorAll('#cluster tr[data-replica] td.ok')]"
                  ".some(td => td.textContent === 'up')")

    monkeypatch.chdir(tmp_path)  # the client ships ./ml as user code: run it from an empty folder
    llm = scalarlm.SupermassiveIntelligence(api_url=tinker_stack.url)
    job = llm.train([{"input": q, "output": a} for q, a in PAIRS], model_name=tiny,
                    train_args=RECIPE)["job_status"]["model_name"]
    page.wait_for(f"!!document.querySelector('#jobs tr[data-job=\"{job}\"]')")

    # Its page, open while it loads and trains: the curve gains points, pass after pass.
    page.open(f"{tinker_stack.url}/ui/jobs/{job}")
    page.record_changes("job-loss", POINTS)
    page.wait_for("document.getElementById('job-state')?.textContent.trim() === 'COMPLETED'", timeout_s=240)
    page.wait_for(f"+document.querySelector('#job-loss svg').dataset.points === {RECIPE['max_steps']}")
    seen = sorted(set(page.evaluate("window.seen")))
    assert len([n for n in seen if 0 < n < RECIPE["max_steps"]]) >= 1, seen  # drawn while it trained
    # Deployed: the replica has loaded its newest checkpoint, and the page says which replica.
    page.wait_for(f"!!document.querySelector('tr[data-checkpoint=\"{LAST}\"] [data-replica]')", timeout_s=60)
    page.wait_for("document.getElementById('job-deployed').textContent.includes('deployed')")

    with httpx.Client(base_url=tinker_stack.url, timeout=120) as http:
        wait_for(lambda: http.get(f"/v1/megatron/train/{job}").json()["deployed"], 60)
        answered = complete(http, job, PAIRS[0][0])
        assert answered.status_code == 200, answered.text

        page.open(f"{tinker_stack.url}/ui")
        # The replica lists the job's adapter at its step; the request, the version that answered it.
        version = f'[data-adapter="{job}"][data-step="{LAST}"]'
        page.wait_for(f"!!document.querySelector('#cluster a.adapter{version}')")
        page.wait_for(f"!!document.querySelector('#serving tr.answer{version}')")
        # The last events: the job's own among them, newest first.
        page.wait_for("!!document.querySelector('#events li[data-kind=\"jobs.completed\"]')")
        page.screenshot(SHOTS / "overview-1280x800.png")
        page.viewport(390, 844, mobile=True)
        page.open(f"{tinker_stack.url}/ui")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        page.screenshot(SHOTS / "overview-390x844.png")
        page.viewport(1280, 800)

        # A Tinker run: two steps, and the reward its client reports after each.
        client = service.create_lora_training_client(base_model=tiny, rank=4).result()
        run = client.model_id
        vocab = client.get_tokenizer().vocab_size
        for step, reward in ((1, 0.25), (2, 0.5)):
            client.forward_backward(token_rows_data(vocab, 2, 8, seed=step), "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-3 * step)).result()
            posted = http.post(f"/v1/tinker/runs/{run}/metrics",
                               json={"step": step, "metrics": {REWARD: reward, "kl": 0.01 * step}})
            assert posted.status_code == 200, posted.text
        # What a client may not post is refused with a 400 that names it; an unknown run is a 404.
        for bad, named in (({"metrics": {REWARD: float("nan")}}, "metrics"),
                           ({"metrics": {f"m{i}": 1.0 for i in range(65)}}, "metrics"),
                           ({"metrics": {"x" * 129: 1.0}}, "metrics"),
                           ({"metrics": {}}, "metrics"),
                           ({"metrics": {"a": 1.0}, "extra": 1}, "extra")):
            refused = http.post(f"/v1/tinker/runs/{run}/metrics", content=_json(bad),
                                headers={"Content-Type": "application/json"})
            assert refused.status_code == 400 and named in refused.json()["detail"], (bad, refused.text)
        assert http.post("/v1/tinker/runs/nope/metrics", json={"metrics": {"a": 1.0}}).status_code == 404

    page.open(f"{tinker_stack.url}/ui")
    page.wait_for(f"!!document.querySelector('#runs tr[data-run=\"{run}\"]')")
    page.open(f"{tinker_stack.url}/ui/runs/{run}")
    page.wait_for("document.getElementById('run-steps')?.textContent.trim() === '2'")
    assert page.evaluate("+document.querySelector('#run-loss svg').dataset.points") == 2
    page.wait_for(f"+document.querySelector('figure[data-metric=\"{REWARD}\"] svg')?.dataset.points === 2")
    reward = page.evaluate(f"document.querySelector('figure[data-metric=\"{REWARD}\"] svg').ariaLabel")
    assert "last 0.5 at step 2" in reward, reward
    assert page.evaluate("!!document.querySelector('figure[data-metric=\"learning rate\"] svg')")
    page.screenshot(SHOTS / "tinker-run-1280x800.png")


def _json(body: dict) -> bytes:
    import json

    return json.dumps(body, allow_nan=True).encode()
