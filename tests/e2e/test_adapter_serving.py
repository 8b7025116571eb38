"""Serving trained adapters through the whole platform: a LoRA job submitted with the unmodified
``scalarlm`` client and trained by the trainer (local launcher), its checkpoints announced on
CHECKPOINTS, then served by job hash: the gateway routes ``model=<hash>`` and ``latest``, /v1/models
lists the adapter under its base model, the job shows ``deployed``, and an inference replica
started later catches up and serves it alone.

The stack's checkpoint-watcher announces each checkpoint as it appears; the test also announces the
final one itself, as the watcher does, so what it checks here does not hang on the watcher (the same
checkpoint announced twice is one version: a replica loads it once).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import scalarlm

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import AdapterEvent
from loopline.common.local.launcher import stop as stop_proc
from loopline.common.runtime import bus
from loopline.ml.train.checkpoint import latest_checkpoint
from support.checkpoints import announce_checkpoint
from support.stacks import make_stack

PAIRS = [
    ("What is 1 + 1?", " The answer is 2."),
    ("Name a colour.", " Blue, like the sky."),
    ("Say hello.", " Hello there!"),
]
ANSWERS = [a for _, a in PAIRS]
RECIPE = {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 3, "gradient_accumulation_steps": 1,
          "steps_per_checkpoint": 10, "adapter_type": "lora"}


@pytest.fixture(scope="module")
def loop_stack(tmp_path_factory, tiny):
    s = make_stack(tmp_path_factory.mktemp("adapter-stack"), tiny, LOOPLINE_LAUNCHER="local",
                   LOOPLINE_RECONCILE_INTERVAL_S="0.25")
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(loop_stack):
    with httpx.Client(base_url=loop_stack.url, timeout=120) as client:
        yield client


def complete(http, model: str, prompt: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 24})


def announce(stack, checkpoint, job_hash: str, base: str) -> float:
    """Publish as the watcher does; returns when the announce was acknowledged."""
    async def go():
        nc = await bus.connect(stack.nats_url, "test-watcher")
        try:
            # created_at: when the training program renamed the checkpoint into place.
            await announce_checkpoint(nc.jetstream(), checkpoint, job_hash=job_hash, base_model=base,
                                      created_at=checkpoint.stat().st_mtime)
        finally:
            await nc.close()
        return time.time()

    return asyncio.run(go())


def last_loaded(stack, job_hash: str) -> AdapterEvent | None:
    async def go():
        nc = await bus.connect(stack.nats_url, "test-events")
        try:
            msg = await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM,
                                                    subjects.adapter_event(job_hash, "loaded"))
            return AdapterEvent.model_validate_json(msg.data)
        except Exception:  # noqa: BLE001 - none yet
            return None
        finally:
            await nc.close()

    return asyncio.run(go())


def wait_for(what, timeout_s: float, step_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s} s")


@pytest.fixture(scope="module")
def served_job(loop_stack, http, tiny, tmp_path_factory, monkeypatch_module):
    # The client ships ./ml from its working directory as user code: run it from an empty one.
    monkeypatch_module.chdir(tmp_path_factory.mktemp("client"))
    llm = scalarlm.SupermassiveIntelligence(api_url=loop_stack.url)
    job = llm.train([{"input": q, "output": a} for q, a in PAIRS], model_name=tiny,
                    train_args=RECIPE)["job_status"]["model_name"]

    # Known to the trainer, no checkpoint loaded yet (the program takes seconds to start).
    early = complete(http, job, PAIRS[0][0])
    assert early.status_code == 404 and "not deployed yet" in early.json()["error"]["message"]
    assert http.get(f"/v1/megatron/train/{job}").json()["deployed"] is False

    wait_for(lambda: llm.get_training_job(job)["job_status"]["status"] == "COMPLETED", 240, 0.5)
    step, checkpoint = latest_checkpoint(loop_stack.jobs_dir / job)
    announced = announce(loop_stack, checkpoint, job, tiny)
    wait_for(lambda: http.get(f"/v1/megatron/train/{job}").json()["deployed"], 30)
    first = complete(http, job, PAIRS[0][0])
    answered = time.time()
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == ANSWERS[0]
    loaded = wait_for(lambda: (e := last_loaded(loop_stack, job)) and e.step == step and e, 30)
    print(f"\nstep {step} written -> loaded on {loaded.replica}: {loaded.latency_s:.3f} s (load "
          f"{loaded.load_s:.3f} s); test's announce -> first answer {answered - announced:.3f} s")
    return job, step


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_job_hash_and_latest_answer_with_the_trained_adapter(loop_stack, http, tiny, served_job):
    job, step = served_job
    for prompt, answer in PAIRS:
        reply = complete(http, job, prompt).json()
        assert reply["model"] == job and reply["choices"][0]["text"] == answer
    latest = complete(http, "latest", PAIRS[2][0]).json()
    assert latest["model"] == job and latest["choices"][0]["text"] == ANSWERS[2]
    # The unmodified ScalarLM client, model_name = the job hash, as ScalarLM users do.
    llm = scalarlm.SupermassiveIntelligence(api_url=loop_stack.url)
    assert llm.generate([q for q, _ in PAIRS], model_name=job, max_tokens=24) == ANSWERS
    # The base model, still served beside it, does not know the answers.
    base = [complete(http, tiny, q).json()["choices"][0]["text"] for q, _ in PAIRS]
    assert all(b != a for b, a in zip(base, ANSWERS, strict=True))

    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models[job]["parent"] == tiny and models[job]["step"] == step and models[tiny]["parent"] is None
    listed = {m["name"]: m for m in llm.list_models()["models"]}
    assert listed[job]["deployed"] is True

    loaded = last_loaded(loop_stack, job)
    assert loaded.replica == "r0" and loaded.step == step and 0 < loaded.load_s <= loaded.latency_s


def test_replica_started_later_catches_up_and_serves_alone(loop_stack, http, served_job):
    job, step = served_job
    loop_stack.start_replica("r1")
    loaded = wait_for(lambda: (e := last_loaded(loop_stack, job)) and e.replica == "r1" and e, 300, 0.5)
    assert loaded.step == step and loaded.load_s > 0
    stop_proc(loop_stack.inference.pop("r0"))  # now only the late replica can answer
    for prompt, answer in PAIRS:
        reply = complete(http, job, prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == answer
