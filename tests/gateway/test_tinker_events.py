"""Session events over SSE (/v1/tinker/*): a real gateway process on a real nats-server; the events
are published as a session worker publishes them, the records written through the product's own
TinkerStore (support/tinker_records.py). No trainer: these routes only read EVENTS and the KV."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from loopline.common.contracts.tinker_schemas import SessionEvent
from support import tinker_records as records
from support.tinker_records import BASE, TinkerBus


@pytest.fixture(scope="module")
def gateway(lone_gateway):
    return lone_gateway


@pytest.fixture(scope="module")
def tinker(nats_proc, gateway) -> TinkerBus:
    return TinkerBus(nats_proc.info["url"], "tinker-events-test")


def messages(lines: Iterator[str]) -> Iterator[tuple[int, str, SessionEvent]]:
    """(id, event, data) of each SSE message; comments (keepalives) skipped."""
    fields: dict[str, str] = {}
    for line in lines:
        if line == "" and fields:
            yield int(fields["id"]), fields["event"], SessionEvent.model_validate_json(fields["data"])
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value


def step(w, m, n: int) -> SessionEvent:
    return SessionEvent(worker_id=w.worker_id, kind="step", model_id=m.model_id, step=n, loss=4.0 / n)


def test_a_worker_history_then_live_then_its_end(http, tinker):
    s, w = records.session(), records.worker()
    a, b = records.model(s, w, 0), records.model(s, w, 1)
    tinker.put(s, w, a, b)
    created = SessionEvent(worker_id=w.worker_id, kind="created", model_id=a.model_id, base_model=BASE)
    history = [created, step(w, a, 1), step(w, b, 1)]
    seqs = tinker.publish(history)
    with http.stream("GET", f"/v1/tinker/workers/{w.worker_id}/events") as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        stream = messages(resp.iter_lines())
        got = [next(stream) for _ in history]
        assert [(n, kind, e) for n, kind, e in got] == list(zip(seqs, ["created", "step", "step"], history,
                                                              strict=True))
        live = [step(w, a, 2),
                SessionEvent(worker_id=w.worker_id, kind="saved", model_id=a.model_id, step=2,
                             path=f"tinker://{a.model_id}/sampler_weights/s2"),
                SessionEvent(worker_id=w.worker_id, kind="released", model_id=a.model_id, detail="idle"),
                SessionEvent(worker_id=w.worker_id, kind="released", detail="no clients left")]
        tinker.publish(live)
        rest = list(stream)  # ends by itself after the worker's own "released"
    assert [e for _, _, e in rest] == live
    assert rest[0][2].loss == 2.0
    # The worker over (its record says so): its history, then the stream closes.
    tinker.put(w.model_copy(update={"state": "released"}))
    with http.stream("GET", f"/v1/tinker/workers/{w.worker_id}/events") as resp:
        assert [e for _, _, e in messages(resp.iter_lines())] == history + live
    # Resuming after an id: what came after it, nothing twice.
    with http.stream("GET", f"/v1/tinker/workers/{w.worker_id}/events", params={"after": seqs[1]}) as resp:
        assert [e for _, _, e in messages(resp.iter_lines())] == history[2:] + live


def test_a_run_shows_its_own_events_and_ends_with_it(http, tinker):
    s, w = records.session(), records.worker()
    a, b = records.model(s, w, 0), records.model(s, w, 1)
    tinker.put(s, w, a, b)
    history = [step(w, a, 1), step(w, b, 1), step(w, b, 2)]
    tinker.publish(history)
    with http.stream("GET", f"/v1/tinker/runs/{a.model_id}/events") as resp:
        assert resp.status_code == 200
        stream = messages(resp.iter_lines())
        assert next(stream)[2] == history[0]
        live = [step(w, b, 3), step(w, a, 2),
                SessionEvent(worker_id=w.worker_id, kind="released", model_id=a.model_id, detail="idle"),
                step(w, b, 4)]
        tinker.publish(live)
        assert [e for _, _, e in stream] == live[1:3]  # b's are not a's; a's "released" ends it


def test_every_worker_from_now_or_from_the_start(http, gateway, tinker):
    s, w1, w2 = records.session(), records.worker(), records.worker()
    a = records.model(s, w1)
    tinker.put(s, w1, w2, a)
    before = tinker.publish([step(w1, a, 1)])
    failed = SessionEvent(worker_id=w2.worker_id, kind="failed", detail="its Slurm job ended FAILED")
    got: list[tuple[int, str, SessionEvent]] = []
    with httpx.Client(base_url=gateway.url, timeout=30) as client, \
            client.stream("GET", "/v1/tinker/events") as resp:
        assert resp.status_code == 200
        # The stream does not end: publish from beside it once it is open, and stop at the event.
        threading.Thread(target=lambda: (time.sleep(0.2), tinker.publish([failed])), daemon=True).start()
        for message in messages(resp.iter_lines()):
            got.append(message)
            break
    assert got[0][1:] == ("failed", failed) and got[0][0] > before[0]  # nothing stored before it opened
    with httpx.Client(base_url=gateway.url, timeout=30) as client, \
            client.stream("GET", "/v1/tinker/events", params={"history": "true"}) as resp:
        first = next(messages(resp.iter_lines()))
    assert first[0] <= before[0]  # the stored history comes first
    with httpx.Client(base_url=gateway.url, timeout=30) as client, \
            client.stream("GET", "/v1/tinker/events", params={"after": before[0]}) as resp:
        assert next(messages(resp.iter_lines()))[1:] == ("failed", failed)


@pytest.mark.parametrize("path", [f"/v1/tinker/workers/{'e' * 32}/events", "/v1/tinker/workers/a.>/events",
                                  "/v1/tinker/workers/*/events", f"/v1/tinker/runs/{'e' * 32}:train:0/events",
                                  "/v1/tinker/runs/not-a-run/events"])
def test_unknown_workers_and_runs_are_404(http, path):
    resp = http.get(path)
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json", resp.text
    assert resp.json()["detail"].startswith(("no session worker", "no training run"))


def test_a_negative_resume_point_is_a_422(http):
    resp = http.get("/v1/tinker/events", params={"after": -1})
    assert resp.status_code == 422 and "after" in resp.json()["detail"]
