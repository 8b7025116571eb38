"""Job events over SSE: the stored history first (for a client that comes late), then live events.
The jobs are real: the trainer runs the stand-in program, whose params set when each event comes."""

from __future__ import annotations

import json
import time

import httpx

from loopline.cli.client import parse_sse
from loopline.common.contracts.job_layout import DATASET_FILE
from support.gateway_process import wait_job
from support.training_data import EXAMPLES, archive, jsonlines


def submit(http, max_steps: int, **standin) -> str:
    data = archive({DATASET_FILE: jsonlines(EXAMPLES)})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data)},
                     data={"params": json.dumps({"max_steps": max_steps, **standin})})
    assert resp.status_code == 200, resp.text
    return resp.json()["job_status"]["model_name"]


def sse_messages(lines):
    """(event, data) pairs of an SSE line iterator, read by the CLI's own parser."""
    for message in parse_sse(lines):
        yield message.event, json.loads(message.data)


def test_one_job_history_then_live_then_the_end(http):
    # Six steps of 0.3 s: the stream opens after the first step, so some events are history (stored
    # before it opened) and the rest arrive live, ending with "completed".
    job_hash = submit(http, 6, standin_step_s=0.3)
    while wait_job(http, job_hash, "TRAINING", timeout_s=30)["step"] < 1:
        time.sleep(0.05)
    with http.stream("GET", f"/v1/megatron/train/{job_hash}/events") as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        messages = sse_messages(resp.iter_lines())
        history = [next(messages) for _ in range(3)]
        assert [kind for kind, _ in history] == ["queued", "started", "progress"]
        assert history[2][1]["loss"] == 0.5 and history[2][1]["job_hash"] == job_hash
        assert [data["seq"] for _, data in history] == [1, 2, 3]
        assert wait_job(http, job_hash, "TRAINING", timeout_s=0)["step"] < 6  # the rest is to come
        live = list(messages)  # the stream ends by itself after "completed"
    story = [kind for kind, _ in history + live]
    assert story == ["queued", "started"] + ["progress"] * 6 + ["checkpoint", "completed"], story
    assert [data["seq"] for _, data in history + live] == list(range(1, len(story) + 1))
    assert [data["step"] for kind, data in live if kind == "progress"][-1] == 6
    assert live[-1][1]["status"] == "COMPLETED"
    # Coming back after the end: the whole story, then the stream closes.
    with http.stream("GET", f"/v1/megatron/train/{job_hash[:10]}/events") as resp:
        assert [kind for kind, _ in sse_messages(resp.iter_lines())] == story


def test_all_jobs_stream(http, gateway):
    # The first job fails once its stand-in has "loaded" for 1.5 s; the second stays queued.
    first = submit(http, 32, standin_start_s=1.5, standin_fail="RuntimeError: out of memory")
    second = submit(http, 33, standin_start_s=120)
    seen: list[tuple[str, str]] = []
    with httpx.Client(base_url=gateway.url, timeout=10) as client, \
            client.stream("GET", "/v1/megatron/events") as resp:
        assert resp.status_code == 200
        for kind, data in sse_messages(resp.iter_lines()):
            seen.append((data["job_hash"], kind))
            if (first, "failed") in seen:
                assert data["error"] == "RuntimeError: out of memory" and data["status"] == "FAILED"
                break
    assert (first, "queued") in seen and (second, "queued") in seen
    assert seen.index((first, "queued")) < seen.index((second, "queued")) < seen.index((first, "failed"))


def test_unknown_job_events_are_404(http):
    resp = http.get(f"/v1/megatron/train/{'e' * 64}/events")
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json"


def test_a_restarted_job_streams_its_new_run_not_the_old_ones_end(http):
    # Cancelled while its stand-in "loads" (no run gets far), then restarted: the job's stream
    # follows the new run from its "queued" to its "completed"; the first run's "cancelled" is not
    # this job's end any more.
    job_hash = submit(http, 4, standin_start_s=0.5, standin_step_s=0.05)
    assert http.post(f"/v1/megatron/cancel/{job_hash}").status_code == 200
    wait_job(http, job_hash, "CANCELLED", timeout_s=30)
    assert http.post(f"/v1/megatron/restart/{job_hash}").status_code == 200
    with http.stream("GET", f"/v1/megatron/train/{job_hash}/events") as resp:
        story = list(sse_messages(resp.iter_lines()))
    kinds = [kind for kind, _ in story]
    assert kinds[0] == "queued" and kinds[-1] == "completed" and "cancelled" not in kinds, kinds
    assert story[-1][1]["status"] == "COMPLETED"
    seqs = [data["seq"] for _, data in story]
    assert seqs == sorted(seqs) and seqs[0] > 1, seqs  # the new run's own events, in order
