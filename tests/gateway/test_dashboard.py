"""The dashboard (``/ui``) on a real gateway process with API keys, the real trainer (the stand-in
training program: tests/trainer/standin.py, a step every 0.2 s with loss 1/(step+1)) and a real
headless Chromium (support/browser.py).

What a person sees: signing in with a key (a session in an HttpOnly cookie that only ``/ui`` takes), the
key's own jobs and never another's, a job's loss curve gaining points while it trains over one live
connection, the job's forms (cancel, restart) doing what the API does for that key, pages that work
with JavaScript off, keyboard navigation, and the layout at 1280x800 and at phone width; and what an
attacker gets: nothing from another origin's form, nothing from the cookie on the API routes.

Screenshots go to ``.loopline/screenshots/`` (git-ignored): the job page while its curve grows, at
desktop and phone width.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.local import launcher
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from support.browser import SCREENSHOTS as SHOTS, Browser, Page, other_site, require_chromium
from support.gateway_process import start_gateway, wait_job
from support.scrape import scrape, value
from support.training_data import EXAMPLES, archive, jsonlines

# A keyed gateway, the trainer and Chromium: ~30 s, out of the edit loop.
pytestmark = pytest.mark.slow

KEYS = {name: new_key() for name in ("a", "b", "infer", "boss")}
SCOPES = {"a": ["training", "inference"], "b": ["training"], "infer": ["inference"], "boss": ["admin"]}
# Long enough to watch, on a busy machine too: 60 steps of 0.25 s, a checkpoint every 20.
SLOW = {"max_steps": 60, "standin_step_s": 0.25, "steps_per_checkpoint": 20}
# The stand-in "loads its model" this long first: the job stays QUEUED.
LOADING = {"max_steps": 3, "standin_start_s": 120}
EVIL = "evil.example"
# The loss chart's point count, as a page shows it.
POINTS = "+(document.querySelector('#job-loss svg')?.dataset.points ?? 0)"


@pytest.fixture(scope="module")
def keyed(nats_proc, trainer, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    write_key_file(path, KeyFile(keys=[KeyEntry(name=name, sha256=key_hash(key), scopes=SCOPES[name])
                                       for name, key in KEYS.items()]))
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("dashboard"),
                       LOOPLINE_API_KEYS_FILE=str(path), LOOPLINE_UI_REFRESH_S="0.5")
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    require_chromium()
    with Browser(tmp_path_factory.mktemp("chromium"), resolve={EVIL: "127.0.0.1"}) as b:
        yield b


def api(gw, name: str) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=30, headers={"Authorization": f"Bearer {KEYS[name]}"})


def submit(http: httpx.Client, params: dict, tag: str) -> str:
    data = archive({DATASET_FILE: jsonlines([*EXAMPLES, {"input": tag, "output": "dashboard"}])})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data, "application/octet-stream")},
                     data={"params": json.dumps(params)})
    assert resp.status_code == 200, resp.text
    return resp.json()["job_status"]["model_name"]


def sign_in(page: Page, gw, name: str) -> None:
    """As a person would: the dashboard sends a browser without the cookie to the sign-in page,
    whose key field has the focus; type the key, press Enter."""
    page.open(f"{gw.url}/ui")
    assert page.evaluate("location.pathname") == "/ui/login"
    assert page.evaluate("document.activeElement.id") == "key"
    page.type_text(KEYS[name])
    page.press("Enter", "Enter", 13, "\r")
    page.wait_for("location.pathname === '/ui' && document.readyState === 'complete'")


def live_pages(gw) -> float:
    return value(scrape(f"{gw.url}/metrics"), "loopline_gateway_live_pages") or 0.0


def test_a_key_signs_in_and_watches_its_own_job_train_live(keyed, browser):
    page = browser.page()
    sign_in(page, keyed, "a")
    # The key is in a cookie no script can read.
    assert page.evaluate("document.cookie") == ""
    assert "key a" in page.evaluate("document.querySelector('.who').textContent")
    with api(keyed, "a") as a, api(keyed, "b") as b:
        mine = submit(a, SLOW, "mine")
        theirs = submit(b, LOADING, "theirs")
        # Its own job appears on the open overview (live); another key's never does.
        page.wait_for(f"!!document.querySelector('tr[data-job=\"{mine}\"]')")
        assert theirs not in page.evaluate("document.body.innerHTML")

        page.viewport(1280, 800)
        page.open(f"{keyed.url}/ui/jobs/{mine}")
        page.record_changes("job-loss", POINTS)
        page.wait_for("document.getElementById('live-status').textContent.startsWith('live')")
        # The curve gains points while the job trains, over the one stream the page holds.
        page.wait_for("window.seen.length >= 3", timeout_s=30)
        assert live_pages(keyed) == 1
        page.screenshot(SHOTS / "job-training-1280x800.png")
        # It ends COMPLETED with the loss the stand-in logs, its checkpoints listed.
        page.wait_for("document.getElementById('job-state')?.textContent.trim() === 'COMPLETED'",
                      timeout_s=90)
        page.wait_for(f"+document.querySelector('#job-loss svg').dataset.points >= {SLOW['max_steps']}")
        growing = sorted(set(page.evaluate("window.seen")))
        assert len([n for n in growing if 0 < n < SLOW["max_steps"]]) >= 2, growing
        assert page.evaluate("document.querySelectorAll('tr[data-checkpoint]').length") >= 1
        label = page.evaluate("document.querySelector('#job-loss svg').getAttribute('aria-label')")
        assert "last 0.01639 at step 60" in label, label  # 1/(60+1)
        assert page.evaluate("document.querySelector('#job-log pre')?.textContent.length ?? 0") > 0
        # Bounded: however many updates came, the page holds about as many nodes as it loaded with.
        updates = int(page.evaluate("+document.body.dataset.updates"))
        assert updates >= 5
        nodes = page.evaluate("document.getElementsByTagName('*').length")
        assert nodes < 400, nodes

        # At phone width nothing runs off the side: tables scroll inside their own box.
        page.viewport(390, 844, mobile=True)
        page.open(f"{keyed.url}/ui/jobs/{mine}")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        page.screenshot(SHOTS / "job-done-390x844.png")
        page.viewport(1280, 800)
        page.call("Page.close")
        deadline = time.monotonic() + 10
        while live_pages(keyed) and time.monotonic() < deadline:  # the stream ends with its page
            time.sleep(0.1)
        assert live_pages(keyed) == 0


def test_the_cookie_opens_the_dashboard_only_and_scopes_hold(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as anon:
        assert anon.get("/ui").status_code == 303
        assert anon.get("/ui").headers["location"] == "/ui/login"
        assert anon.get("/ui/live?page=overview").status_code == 401
        assert anon.get("/ui/login").status_code == 200
        assert anon.get("/ui/static/live.js").status_code == 200
        # Only the dashboard's own files, by name: nothing else of the package is served.
        assert anon.get("/ui/static/__init__.py").status_code == 404
        assert "import" not in anon.get("/ui/static/..%2Fpages.py").text
        wrong = anon.post("/ui/login", data={"key": "tml-not-a-key"})
        assert wrong.status_code == 401 and "not one of this gateway&#39;s API keys" in wrong.text
        signed = anon.post("/ui/login", data={"key": KEYS["a"]})
        assert signed.status_code == 303
        cookie = signed.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
        session = signed.cookies["loopline_session"]  # the session's id (test_ui_sessions.py)
    with httpx.Client(base_url=keyed.url, timeout=30, cookies={"loopline_session": session}) as signed_in:
        page = signed_in.get("/ui")
        assert page.status_code == 200
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        # The same cookie on an API route is no key at all.
        assert signed_in.get("/v1/megatron/list_models").status_code == 401
    with api(keyed, "a") as a, api(keyed, "b") as b, api(keyed, "infer") as infer, api(keyed, "boss") as boss:
        job = submit(a, LOADING, "scopes")
        assert a.get(f"/ui/jobs/{job}").status_code == 200
        # Another tenant's job is unknown, on the page and on its live stream.
        assert b.get(f"/ui/jobs/{job}").status_code == 404
        assert b.get(f"/ui/live?page=job&id={job}").status_code == 404
        assert job not in b.get("/ui").text
        # An inference key sees the cluster, not jobs; its job page is the API's 403.
        overview = infer.get("/ui")
        assert overview.status_code == 200 and "need a key with the training scope" in overview.text
        assert infer.get(f"/ui/jobs/{job}").status_code == 403
        # Admin sees every job and the queue's figures (none here: no queue service runs).
        assert job in boss.get("/ui").text
        assert "needs a key with the admin scope" in a.get("/ui").text
        assert "needs a key with the admin scope" not in boss.get("/ui").text
        # Delete is admin's, as /v1/megatron/delete.
        assert a.post(f"/ui/jobs/{job}/delete").status_code == 403
        assert b.post(f"/ui/jobs/{job}/cancel").status_code == 404


def test_the_job_forms_act_for_their_key_and_not_for_another_site(keyed, browser):
    with api(keyed, "a") as a:
        job = submit(a, LOADING, "forms")
        page = browser.page()
        page.open(f"{keyed.url}/ui/jobs/{job}")  # signed in by the first test: the cookie is kept
        if page.evaluate("location.pathname") == "/ui/login":
            sign_in(page, keyed, "a")
            page.open(f"{keyed.url}/ui/jobs/{job}")
        # A page of another site posts the job's cancel form: refused by same_origin.py before the
        # key is looked at (the cookie's own SameSite defence: test_dashboard_hostile_browser.py).
        with other_site(EVIL) as site:
            site.html = (f'<form id="f" method="post" action="{keyed.url}/ui/jobs/{job}/cancel"></form>'
                         '<script>document.getElementById("f").submit()</script>').encode()
            attack = browser.page()
            attack.open(site.url)
            attack.wait_for("location.pathname.endsWith('/cancel') && document.readyState === 'complete'")
            assert "cross-site request refused" in attack.evaluate("document.body.textContent")
        assert wait_job(a, job, "QUEUED", "RUNNING")["status"] in ("QUEUED", "RUNNING")
        # The key's own page cancels it, by keyboard: focus the button, press Enter.
        page.evaluate("document.querySelector('form[action$=\"/cancel\"] button').focus()")
        page.press("Enter", "Enter", 13, "\r")
        page.wait_for("location.search.includes('notice=')")
        assert "cancel: done" in page.evaluate("document.querySelector('.message').textContent")
        wait_job(a, job, "CANCELLED")
        page.wait_for("document.getElementById('job-state')?.textContent.trim() === 'CANCELLED'")
        # Restarting a cancelled job is allowed once its run has stopped; the page says what happened.
        page.evaluate("document.querySelector('form[action$=\"/restart\"]').submit()")
        page.wait_for("location.search.includes('restart')")
        assert page.evaluate("document.querySelector('.message').textContent").startswith("restart")


def test_pages_work_without_javascript_and_by_keyboard(keyed, browser):
    with api(keyed, "a") as a:
        job = submit(a, {"max_steps": 5}, "static")
        wait_job(a, job, "COMPLETED")
    page = browser.page()
    page.without_javascript()
    page.open(f"{keyed.url}/ui/jobs/{job}")
    if page.evaluate("location.pathname") == "/ui/login":  # no script: the form posts all the same
        sign_in(page, keyed, "a")
        page.open(f"{keyed.url}/ui/jobs/{job}")
    status = page.evaluate("document.getElementById('live-status').textContent")
    assert "live updates need JavaScript" in status
    assert page.evaluate("+document.querySelector('#job-loss svg').dataset.points") == 5
    assert page.evaluate("document.getElementById('job-state').textContent.trim()") == "COMPLETED"
    # Keyboard: the first Tab reaches the skip link, the next ones the navigation and then the job.
    page = browser.page()
    page.open(f"{keyed.url}/ui")
    page.press("Tab", "Tab", 9)
    assert page.evaluate("document.activeElement.className") == "skip"
    reached = []
    focused = "document.activeElement.getAttribute('href') ?? document.activeElement.tagName"
    for _ in range(12):
        page.press("Tab", "Tab", 9)
        reached.append(page.evaluate(focused))
    assert "/ui" in reached and f"/ui/jobs/{job}" in reached, reached
