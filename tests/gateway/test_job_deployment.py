"""A job whose checkpoint no replica can load says so, wherever a user looks: its info
(``deployed: false`` and the replica's reason), the list of jobs, its event stream (an
``adapter.rejected`` event, then the stream ends), ``loopline follow`` (exit 1 with the reason) and
``latest`` (which does not name it).

The job is real (the trainer runs the stand-in program) and a replica of its base model answers the
gateway's census (support/census_replica.py). The rejection is the event a replica publishes when
its engine refuses an adapter (``events.adapters.<hash>.rejected``, AdapterEvent): that a real vLLM
replica sends it, with the engine's reason, is tests/inference/test_adapters_runtime.py's part."""

from __future__ import annotations

import json
import threading
import time

import pytest
from typer.testing import CliRunner

from loopline.cli.client import parse_sse
from loopline.cli.main import app as cli_app
from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.job_schemas import AdapterEvent
from loopline.common.contracts.schemas import DeploymentInfo
from support.census_replica import census_replica
from support.gateway_process import BASE_MODEL, wait_job
from support.training_data import EXAMPLES, archive, jsonlines

BASE = DeploymentInfo(model=BASE_MODEL, deployment=BASE_MODEL, max_model_len=256, engine="vllm",
                      max_adapter_rank=8)
REASON = "LoRA rank 16 is greater than max_lora_rank 8"
STEPS = 2


@pytest.fixture(scope="module")
def base_served(nats_proc, gateway):
    """A replica of the jobs' base model, up as far as the gateway can tell (listed in /v1/models)."""
    with census_replica(nats_proc.info["url"], BASE, "r-test"):
        yield


def submit(http, seed: int) -> str:
    """A new job each seed (the same params and data are the same job)."""
    data = archive({DATASET_FILE: jsonlines(EXAMPLES)})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data)},
                     data={"params": json.dumps({"max_steps": STEPS, "standin_step_s": 0.3, "seed": seed})})
    assert resp.status_code == 200, resp.text
    return resp.json()["job_status"]["model_name"]


def sse_messages(lines):
    """(event, data) pairs of an SSE line iterator, read by the CLI's own parser."""
    for message in parse_sse(lines):
        yield message.event, json.loads(message.data)


def publish(nats_bus, event: AdapterEvent) -> None:
    subject = subjects.adapter_event(event.job_hash, event.kind)
    nats_bus.ask(lambda nc: nc.jetstream().publish(subject, event.model_dump_json().encode()))


def reject(nats_bus, job_hash: str, step: int) -> None:
    """What a replica whose engine refused the checkpoint publishes."""
    publish(nats_bus, AdapterEvent(job_hash=job_hash, kind="rejected", step=step, reason=REASON,
                                   replica="r-test"))


def wait_listed(http) -> None:
    deadline = time.monotonic() + 30
    while BASE_MODEL not in {m["id"] for m in http.get("/v1/models").json()["data"]}:
        assert time.monotonic() < deadline, "the census replica never showed in /v1/models"
        time.sleep(0.2)


def test_a_rejected_checkpoint_is_on_the_stream_in_the_info_and_not_latest(http, nats_bus, base_served):
    wait_listed(http)
    job_hash = submit(http, seed=1)
    seen: list[tuple[str, dict]] = []
    rejected_at = ended_at = 0.0
    with http.stream("GET", f"/v1/megatron/train/{job_hash}/events") as resp:
        assert resp.status_code == 200
        for kind, data in sse_messages(resp.iter_lines()):
            seen.append((kind, data))
            if kind == "completed":
                # A replica is up for the base model: the stream stays open for the deployment of
                # the newest checkpoint; the replica refuses it now.
                checkpoint = next(d for k, d in seen if k == "checkpoint")["checkpoint"]["step"]
                assert checkpoint == STEPS
                rejected_at = time.monotonic()
                threading.Thread(target=reject, args=(nats_bus, job_hash, checkpoint)).start()
        ended_at = time.monotonic()
    kinds = [kind for kind, _ in seen]
    assert kinds[-2:] == ["completed", "adapter.rejected"], kinds
    last = seen[-1][1]
    assert last["reason"] == REASON and last["replica"] == "r-test" and last["step"] == STEPS, last
    assert ended_at - rejected_at < 10  # ended by the rejection, not by the 30 s wait

    info = http.get(f"/v1/megatron/train/{job_hash}").json()
    assert info["deployed"] is False and info["deployment_error"] == REASON, info
    entry = next(m for m in http.get("/v1/megatron/list_models").json()["models"] if m["name"] == job_hash)
    assert entry["deployed"] is False and entry["deployment_error"] == REASON, entry
    # latest names a job some replica serves, and this one none does.
    latest = http.post("/v1/completions", json={"model": "latest", "prompt": "hi", "max_tokens": 1})
    assert latest.status_code == 404 and "no training job has a deployed adapter" in latest.text, latest.text
    named = http.post("/v1/completions", json={"model": job_hash, "prompt": "hi", "max_tokens": 1})
    assert named.status_code == 404 and REASON in named.text, named.text

    # Followed after the fact: the stored story, the rejection last; exit 1 with the reason.
    result = CliRunner().invoke(cli_app, ["--url", str(http.base_url), "follow", job_hash[:12]])
    assert result.exit_code == 1, result.output
    assert f"completed {job_hash} at step {STEPS}/{STEPS}" in result.output
    assert "not served" in result.output and REASON in " ".join(result.output.split()), result.output
    status = CliRunner().invoke(cli_app, ["--url", str(http.base_url), "status", job_hash[:12]])
    assert status.exit_code == 0 and REASON in " ".join(status.output.split()), status.output


def test_a_loaded_checkpoint_ends_the_stream_and_clears_the_error(http, nats_bus, base_served):
    wait_listed(http)
    job_hash = submit(http, seed=2)
    wait_job(http, job_hash, "COMPLETED", timeout_s=60)
    reject(nats_bus, job_hash, STEPS)
    publish(nats_bus, AdapterEvent(job_hash=job_hash, kind="loaded", step=STEPS, replica="r-test",
                                   base_model=BASE_MODEL, adapter_type="lora", latency_s=0.2))
    with http.stream("GET", f"/v1/megatron/train/{job_hash}/events") as resp:
        kinds = [kind for kind, _ in sse_messages(resp.iter_lines())]
    assert kinds[-3:] == ["completed", "adapter.rejected", "adapter.loaded"], kinds
    deadline = time.monotonic() + 10
    while (info := http.get(f"/v1/megatron/train/{job_hash}").json())["deployed"] is not True:
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    assert info.get("deployment_error") is None, info
    result = CliRunner().invoke(cli_app, ["--url", str(http.base_url), "follow", job_hash[:12]])
    assert result.exit_code == 0 and f"loaded step {STEPS}" in result.output, result.output
