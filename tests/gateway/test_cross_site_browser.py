"""A drive-by attack from a real browser: a headless Chromium opens a page of another site
(``evil.example``, served here by a tiny http.server) that sends the gateway what a page can send
without asking (no-cors ``fetch``): a training archive whose ``ml/sitecustomize.py`` would write a
marker file as the trainer's job user, ``clear_queue`` as ``text/plain``, and a completion.

The gateway runs as ``make up`` runs it (no API keys, the trainer running shipped ``ml/`` code: the
module's trainer, tests/gateway/conftest.py), with a real queue service and a deployment record, so
every one of these would do its harm if let through (and does, from the gateway's own origin: the
same requests from a page of the gateway's origin are the control). Asserted: the browser sent all
three, the gateway answered each 403 (its own count), no job exists, the marker was not written,
the queue kept what it held, and no completion was queued; and a page that reaches the gateway by
a name of its own resolving to 127.0.0.1 (DNS rebinding) is refused as well."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import is_job_hash
from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.local import launcher
from loopline.common.runtime import bus
from support.browser import Browser, Site, other_site, require_chromium
from support.bus_view import BusView
from support.gateway_process import BASE_MODEL, start_gateway
from support.scrape import scrape, value
from support.training_data import EXAMPLES, archive, jsonlines

EVIL = "evil.example"
REBOUND = "rebound.example"  # the attacker's name, made to resolve to 127.0.0.1
DEPLOYMENT = "cross-site-dep"
ATTACKS = {"train": "/v1/megatron/train", "clear_queue": "/v1/generate/clear_queue",
           "completion": "/v1/completions"}

# What a page sends (no-cors: a multipart form, text/plain bodies; it cannot read the answers).
PAGE_SCRIPT = """
const archive = Uint8Array.from(atob(%(archive)s), c => c.charCodeAt(0));
async function send(name, path, init) {
  try {
    const answer = await fetch(%(gateway)s + path, {method: "POST", ...init});
    return {name, type: answer.type, status: answer.status};
  } catch (e) {
    return {name, type: "error", status: String(e)};
  }
}
function attack(mode, names) {
  const form = new FormData();
  form.append("file", new Blob([archive]), "dataset");
  form.append("params", JSON.stringify({max_steps: 2}));
  const text = {mode, headers: {"Content-Type": "text/plain"}};
  const requests = {
    train: () => send("train", "/v1/megatron/train", {mode, body: form}),
    clear_queue: () => send("clear_queue", "/v1/generate/clear_queue", {...text, body: ""}),
    completion: () => send("completion", "/v1/completions",
        {...text, body: JSON.stringify({model: %(model)s, prompt: "hi", max_tokens: 1})}),
  };
  return Promise.all(names.map(name => requests[name]()));
}
"""


def page_script(gateway: str, archive_bytes: bytes) -> str:
    return PAGE_SCRIPT % {"archive": json.dumps(base64.b64encode(archive_bytes).decode()),
                          "gateway": json.dumps(gateway), "model": json.dumps(BASE_MODEL)}


def shipped_code(marker: Path) -> bytes:
    """A training archive whose ml/sitecustomize.py, run by any Python the job starts, writes ``marker``."""
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('user code ran')\n"
    return archive({DATASET_FILE: jsonlines([*EXAMPLES, {"input": marker.name, "output": "x"}]),
                    "ml/sitecustomize.py": code.encode()})


@pytest.fixture(scope="module")
def chromium() -> str:
    return require_chromium()


@pytest.fixture(scope="module")
def deployment(nats_bus, queue_service) -> None:
    """A deployment of the gateway's model with its work consumer (what a replica announces when it
    starts) and no replica: completions are queued for it and wait, and clear_queue clears them."""
    info = DeploymentInfo(model=BASE_MODEL, deployment=DEPLOYMENT, max_model_len=128, engine="vllm")

    async def deploy(nc) -> None:
        js = nc.jetstream()
        await (await js.key_value(subjects.MODELS_BUCKET)).put(DEPLOYMENT, info.model_dump_json().encode())
        await bus.ensure_work_consumer(js, DEPLOYMENT, ack_wait_s=30, max_deliver=5)

    nats_bus.ask(deploy)


@pytest.fixture(scope="module")
def make_up_gateway(nats_proc, trainer, deployment, tmp_path_factory):
    """No keys, as ``make up``; a long grace, so the deployment without replicas takes completions."""
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("gateway"),
                       LOOPLINE_REPLICA_GRACE_S="3600")
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture
def evil_site() -> Iterator[Site]:
    """``http://evil.example:<port>/`` (the browser resolves the name to 127.0.0.1)."""
    with other_site(EVIL) as site:
        yield site


def refused(gateway_url: str) -> dict[str, float]:
    samples = scrape(f"{gateway_url}/metrics")
    return {name: value(samples, "loopline_gateway_requests_total", route=route, method="POST",
                        status="403") or 0 for name, route in ATTACKS.items()}


def work_queued(nats_url: str) -> int:
    async def count(nc) -> int:
        return (await nc.jetstream().stream_info(subjects.WORK_STREAM)).state.messages
    return BusView(nats_url).ask(count)


def jobs(jobs_dir: Path) -> set[str]:
    """The jobs the trainer has made (a folder each, named by its hash)."""
    return {p.name for p in jobs_dir.iterdir() if is_job_hash(p.name)} if jobs_dir.is_dir() else set()


def wait_until(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    # Invariant: check() has been false every time so far.
    while not check():
        assert time.monotonic() < deadline, f"{what} after {timeout_s} s"
        time.sleep(0.1)


# Tier: Chromium, the queue service and the trainer's job, ~10 s.
@pytest.mark.slow
def test_a_page_of_another_site_can_neither_train_nor_clear_nor_infer(
        chromium, make_up_gateway, trainer, nats_proc, evil_site, tmp_path):
    gateway, nats_url = make_up_gateway.url, nats_proc.info["url"]
    cross_marker, own_marker = tmp_path / "cross-site-marker", tmp_path / "same-origin-marker"
    with Browser(tmp_path / "browser", resolve={EVIL: "127.0.0.1", REBOUND: "127.0.0.1"}) as browser:
        # A page of the gateway's own origin queues a completion: no replica serves it, it waits.
        own = browser.page()
        own.open(f"{gateway}/v1/health/keepalive")
        own.evaluate(page_script("", shipped_code(own_marker)))
        own.evaluate("window.completion = attack('same-origin', ['completion']); true")
        wait_until(lambda: work_queued(nats_url) == 1, "the same-origin completion is not queued")
        jobs_before = jobs(trainer.jobs_dir)
        refused_before = refused(gateway)

        # The attack: the page of evil.example sends all three as soon as it loads.
        evil_site.html = (f"<script>{page_script(gateway, shipped_code(cross_marker))}\n"
                          f"window.sent = attack('no-cors', {json.dumps(list(ATTACKS))});</script>").encode()
        evil = browser.page()
        evil.open(evil_site.url)
        sent = evil.evaluate("window.sent")
        # The browser sent each one (an opaque answer: the page cannot read it).
        assert [s["type"] for s in sent] == ["opaque"] * len(ATTACKS), sent

        added = {name: n - refused_before[name] for name, n in refused(gateway).items()}
        assert added == dict.fromkeys(ATTACKS, 1), added  # the gateway refused each one itself
        assert work_queued(nats_url) == 1  # no completion queued beside the one already waiting

        # DNS rebinding: a name of the attacker's resolving to 127.0.0.1 makes the gateway the page's
        # own origin to the browser (it can even read the answer); the gateway knows its names.
        rebound = browser.page()
        rebound.open(f"http://{REBOUND}:{gateway.rpartition(':')[2]}/v1/health/keepalive")
        answer = rebound.evaluate('fetch("/v1/generate/clear_queue", {method: "POST"})'
                                  '.then(async r => [r.status, (await r.json()).detail])')
        assert answer[0] == 403 and "DNS rebinding" in answer[1], answer
        # Nor can it read: its GETs are same-origin to the browser, which would hand it the answer.
        read = rebound.evaluate('fetch("/v1/megatron/list_models")'
                                '.then(async r => [r.status, await r.text()])')
        assert read[0] == 403 and "DNS rebinding" in read[1], read

        # From the gateway's own origin the same requests work: the queue still holds its one
        # completion (the cross-site clear cleared nothing), which the clear now cancels (410) ...
        cleared = own.evaluate('fetch("/v1/generate/clear_queue", {method: "POST"}).then(r => r.json())')
        assert cleared == {"cleared": 1}, cleared
        assert [(s["name"], s["status"]) for s in own.evaluate("window.completion")] == [("completion", 410)]
        # ... and a training archive makes a job whose shipped code runs.
        sent_own = own.evaluate("attack('same-origin', ['train'])")
        assert [(s["name"], s["status"]) for s in sent_own] == [("train", 200)], sent_own
        wait_until(own_marker.exists, "the same-origin job's shipped code did not run", timeout_s=60)

    # The cross-site archive made no job, so its code never ran (the same-origin one's has, by now).
    assert len(jobs(trainer.jobs_dir) - jobs_before) == 1
    assert not cross_marker.exists()
    # Clients that are not browsers (no Origin) are let through as before.
    resp = httpx.post(f"{gateway}/v1/generate/clear_queue", timeout=30)
    assert resp.status_code == 200 and resp.json() == {"cleared": 0}, resp.text
