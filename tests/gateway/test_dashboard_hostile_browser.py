"""What a tenant writes cannot act in another's (or its own) dashboard, in a real headless Chromium
(support/browser.py) on a real keyed gateway process with the real trainer (the stand-in training
program) and nats-server.

- A job whose error, parameters and log, and a Tinker run whose metric names and error, carry
  ``<script>`` and ``<img onerror>``: the pages show them as text, no such element exists and none of
  their script ran (Jinja2's autoescaping, with the pages' CSP behind it).
- A job page's alert says only what the gateway chose (``?notice=`` codes), never a URL's text.
- The dashboard's own defence against cross-site forms, its ``SameSite=Strict`` session cookie,
  tested on its own: this gateway lists the attacker's origin in ``LOOPLINE_ALLOWED_ORIGINS``, so the
  same-origin middleware lets the forged form through, and only the cookie's staying home stops it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.tinker_schemas import LoraSpec, TinkerModel
from loopline.common.local import launcher
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from support.browser import Browser, Page, other_site, require_chromium
from support.gateway_process import BASE_MODEL, start_gateway, wait_job
from support.training_data import EXAMPLES, archive, jsonlines

# A keyed gateway, the trainer and Chromium: ~20 s, out of the edit loop.
pytestmark = pytest.mark.slow

KEYS = {"a": new_key()}
EVIL = "evil.example"
# Each would set window.pwned if it ran; each is also an element that must not exist.
HOSTILE = '<script>window.pwned = "script"</script><img src=x onerror="window.pwned = \'img\'">'
INJECTED = "document.querySelectorAll('main script, img[onerror], [onerror]').length"
PHISH = "Your key expired: paste it at http://evil.example/renew"
RUN = "hostile-run"


@pytest.fixture(scope="module")
def site():
    with other_site(EVIL) as evil:
        yield evil


@pytest.fixture(scope="module")
def keyed(nats_proc, trainer, site, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    write_key_file(path, KeyFile(keys=[KeyEntry(name="a", sha256=key_hash(KEYS["a"]),
                                                scopes=["training", "inference"])]))
    # The attacker's origin is trusted: same_origin.py lets its forms through, so the cookie alone
    # must stop them.
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("hostile"),
                       LOOPLINE_API_KEYS_FILE=str(path), LOOPLINE_UI_REFRESH_S="0.5",
                       LOOPLINE_ALLOWED_ORIGINS=site.url.rstrip("/"))
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    require_chromium()
    with Browser(tmp_path_factory.mktemp("chromium"), resolve={EVIL: "127.0.0.1"}) as b:
        yield b


@pytest.fixture(scope="module")
def page(keyed, browser) -> Page:
    signed_in = browser.page()
    signed_in.open(f"{keyed.url}/ui")
    signed_in.evaluate(f"document.getElementById('key').value = {KEYS['a']!r}")
    signed_in.evaluate("document.querySelector('form.login').submit()")
    signed_in.wait_for("location.pathname === '/ui' && document.readyState === 'complete'")
    return signed_in


def api(gw) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=30, headers={"Authorization": f"Bearer {KEYS['a']}"})


def submit(http: httpx.Client, params: dict, tag: str) -> str:
    data = archive({DATASET_FILE: jsonlines([*EXAMPLES, {"input": tag, "output": "hostile"}])})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data, "application/octet-stream")},
                     data={"params": json.dumps(params)})
    assert resp.status_code == 200, resp.text
    return resp.json()["job_status"]["model_name"]


def assert_inert(page: Page, shown: str) -> None:
    """``shown`` is on the page as text, and nothing of it became an element or ran."""
    assert page.evaluate("window.pwned ?? null") is None
    assert page.evaluate(INJECTED) == 0, page.evaluate("document.querySelector('main').innerHTML")
    assert shown in page.evaluate("document.querySelector('main').textContent")


def test_a_hostile_job_and_run_render_as_text_and_run_nothing(keyed, page, nats_bus):
    with api(keyed) as a:
        job = submit(a, {"max_steps": 3, "standin_fail": f"Boom: {HOSTILE}"}, "hostile")
        failed = wait_job(a, job, "FAILED")
        assert HOSTILE in (failed.get("error") or "")
        # A run of the key's, as a session worker records it, with the client's metric names.
        model = TinkerModel(model_id=RUN, session_id="s1", base_model=BASE_MODEL, model_path="/m",
                            model_name=BASE_MODEL, lora=LoraSpec(rank=4), worker_id="w1", owner="a",
                            state="failed", error=HOSTILE)

        async def put(nc) -> None:
            store = TinkerStore(nc.jetstream(), nc.max_payload)
            await store.start()
            await store.put_model(model)

        nats_bus.ask(put)
        names = {"<script>window.pwned='m'</script>": 1.0, "<img src=x onerror=\"window.pwned='n'\">": 2.0}
        for step in (1, 2):
            posted = a.post(f"/v1/tinker/runs/{RUN}/metrics", json={"step": step, "metrics": names})
            assert posted.status_code == 200, posted.text

    page.open(f"{keyed.url}/ui/jobs/{job}")
    page.wait_for("document.getElementById('live-status').textContent.startsWith('live')")
    page.wait_for("document.querySelector('#job-log pre')?.textContent.includes('Boom') ?? false",
                  timeout_s=30)  # the log tail, as the live stream rewrites it
    assert_inert(page, HOSTILE)
    assert HOSTILE in page.evaluate("document.querySelector('#job-log').textContent")

    page.open(f"{keyed.url}/ui/runs/{RUN}")
    page.wait_for("document.querySelectorAll('figure[data-metric]').length >= 2", timeout_s=30)
    for name in names:
        assert_inert(page, name)
    assert HOSTILE in page.evaluate("document.querySelector('main').textContent")


def test_a_job_page_says_only_what_the_gateway_chose(keyed):
    with api(keyed) as a:
        job = submit(a, {"max_steps": 1}, "notices")
        said = a.get(f"/ui/jobs/{job}", params={"notice": "cancel-done"})
        assert said.status_code == 200 and 'role="alert">cancel: done<' in said.text
        for params in ({"message": PHISH}, {"notice": PHISH}):
            page = a.get(f"/ui/jobs/{job}", params=params)
            assert page.status_code == 200
            assert "evil.example" not in page.text and 'role="alert"' not in page.text


def test_a_cross_site_form_carries_no_session_even_from_a_trusted_origin(keyed, page, browser, site):
    with api(keyed) as a:
        job = submit(a, {"max_steps": 3, "standin_start_s": 120}, "forged")  # stays QUEUED
        site.html = (f'<form id="f" method="post" action="{keyed.url}/ui/jobs/{job}/cancel"></form>'
                     '<script>document.getElementById("f").submit()</script>').encode()
        attack = browser.page()
        attack.open(site.url)
        attack.wait_for(f"location.host !== {EVIL!r} + ':' + {site.url.split(':')[-1].rstrip('/')!r} "
                        "&& document.readyState === 'complete'")
        assert attack.evaluate("location.pathname").endswith("/cancel")  # not sent on to the job's page
        answer = attack.evaluate("document.body.textContent")
        # Past the same-origin middleware (trusted origin), stopped at the key check: no cookie came.
        assert "cross-site request refused" not in answer
        assert "missing API key" in answer, answer
        assert wait_job(a, job, "QUEUED", "RUNNING")["status"] in ("QUEUED", "RUNNING")
        # The control: the same form from the dashboard's own page, with its session, cancels.
        page.open(f"{keyed.url}/ui/jobs/{job}")
        page.evaluate("document.querySelector('form[action$=\"/cancel\"]').submit()")
        page.wait_for("location.search.includes('notice=cancel-')")
        wait_job(a, job, "CANCELLED")
