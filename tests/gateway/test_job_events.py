"""Job events over SSE: the stored history first (for a client that comes late), then live events."""

from __future__ import annotations

import json

import httpx

from loopline.common.job_layout import DATASET_FILE
from support.training_data import EXAMPLES, archive, jsonlines


def submit(http, max_steps: int) -> str:
    data = archive({DATASET_FILE: jsonlines(EXAMPLES)})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data)},
                     data={"params": json.dumps({"max_steps": max_steps})})
    assert resp.status_code == 200, resp.text
    return resp.json()["job_status"]["model_name"]


def sse_messages(lines):
    """(event, data) pairs from an SSE line iterator; comments (keepalives) skipped."""
    event, data = None, None
    for line in lines:
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
        elif line == "" and event is not None:
            yield event, data
            event, data = None, None


def test_one_job_history_then_live_then_the_end(http, trainer):
    job_hash = submit(http, 31)  # the trainer stand-in publishes "queued"
    trainer.emit(job_hash, "started")
    trainer.emit(job_hash, "progress", step=1, max_steps=31, loss=2.5)
    with http.stream("GET", f"/v1/megatron/train/{job_hash}/events") as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        messages = sse_messages(resp.iter_lines())
        history = [next(messages) for _ in range(3)]
        assert [kind for kind, _ in history] == ["queued", "started", "progress"]
        assert history[2][1]["loss"] == 2.5 and history[2][1]["job_hash"] == job_hash
        assert [data["seq"] for _, data in history] == [1, 2, 3]
        trainer.emit(job_hash, "progress", step=2, max_steps=31, loss=2.0)
        trainer.emit(job_hash, "completed")
        live = list(messages)  # the stream ends by itself after "completed"
    assert [kind for kind, _ in live] == ["progress", "completed"]
    assert live[1][1]["status"] == "COMPLETED"
    # Coming back after the end: the whole story, then the stream closes.
    with http.stream("GET", f"/v1/megatron/train/{job_hash[:10]}/events") as resp:
        assert [kind for kind, _ in sse_messages(resp.iter_lines())] == \
            ["queued", "started", "progress", "progress", "completed"]


def test_all_jobs_stream(http, gateway, trainer):
    first, second = submit(http, 32), submit(http, 33)
    seen: list[tuple[str, str]] = []
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        with client.stream("GET", "/v1/megatron/events") as resp:
            assert resp.status_code == 200
            for kind, data in sse_messages(resp.iter_lines()):
                seen.append((data["job_hash"], kind))
                if (second, "queued") in seen and (first, "failed") not in seen:
                    trainer.emit(first, "failed", error="out of memory")
                if (first, "failed") in seen:
                    break
    assert (first, "queued") in seen and (second, "queued") in seen
    assert seen.index((first, "queued")) < seen.index((second, "queued")) < seen.index((first, "failed"))


def test_unknown_job_events_are_404(http):
    resp = http.get(f"/v1/megatron/train/{'e' * 64}/events")
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json"
