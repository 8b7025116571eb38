"""Run-time adapters in one replica: checkpoints announced on CHECKPOINTS (as the checkpoint-watcher
does) are downloaded from the object store, loaded as new versions and served by job hash.

Real parts: nats-server, vLLM's own OpenAI server in-process (as the replica runs it) on the tiny
model, the replica's adapter manager and worker, and LoRA / Tokenformer adapters trained by
``python -m loopline.ml.train`` with the documented recipe, which answers its three pairs exactly.
Requests are vLLM completion requests published on WORK as the gateway publishes them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path

import pytest
import pytest_asyncio

from loopline.common.contracts import adapter_format, subjects
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, CONFIG_FILE, DATASET_FILE, checkpoint_name
from loopline.common.contracts.job_schemas import AdapterEvent
from loopline.common.contracts.schemas import ResultItem, WorkItem
from loopline.common.runtime import bus
from loopline.gateway.core.submit import request_id
from loopline.gateway.core.work import WorkPublisher
from loopline.inference.adapters import AdapterManager
from loopline.inference.vllm_args import serve_flags
from loopline.inference.vllm_server import VllmServer
from loopline.inference.worker import Worker
from support.checkpoints import announce_checkpoint
from support.nats import nats_server
from support.stacks import tiny_model

# Tier: a real vLLM engine per module, 10-20 s to start.
pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.slow]

# The deployment's served name: the base model the checkpoints adapt, and a base request's "model".
BASE = "tiny"

PAIRS = [
    ("What is 1 + 1?", " The answer is 2."),
    ("Name a colour.", " Blue, like the sky."),
    ("Say hello.", " Hello there!"),
]
# docs/adapter-format.md's recipe, with a checkpoint every 3 steps: step 3 is barely trained (its
# answers differ from the final ones), step 30 answers the pairs exactly.
RECIPE = {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 3, "gradient_accumulation_steps": 1,
          "steps_per_checkpoint": 3, "max_checkpoints_to_keep": 20}
ANSWERS = [a for _, a in PAIRS]


def train(root: Path, adapter_type: str, model: str) -> Path:
    job = root / adapter_type
    job.mkdir(parents=True)
    (job / CONFIG_FILE).write_text(json.dumps(
        {"job_hash": f"test-{adapter_type}", "model_path": model,
         "params": {**RECIPE, "adapter_type": adapter_type}}))
    (job / DATASET_FILE).write_text(
        "".join(json.dumps({"input": q, "output": a}) + "\n" for q, a in PAIRS))
    run = subprocess.run([sys.executable, "-m", "loopline.ml.train", "--job-dir", str(job)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return job / CHECKPOINTS_DIR


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / checkpoint_name(step)


def new_hash() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex  # 64 hex characters, like a real job hash


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def lora(tmp_path_factory, tiny):
    return train(tmp_path_factory.mktemp("jobs"), "lora", tiny)


@pytest.fixture(scope="module")
def tokenformer(tmp_path_factory, tiny):
    return train(tmp_path_factory.mktemp("jobs"), "tokenformer", tiny)


class Bus:
    def __init__(self, nc, js):
        self.nc, self.js = nc, js

    async def events(self, job_hash: str) -> asyncio.Queue:
        """Adapter events of one job from now on (subscribe before announcing)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg):
            queue.put_nowait(AdapterEvent.model_validate_json(msg.data))

        await self.nc.subscribe(subjects.adapter_event(job_hash, "*"), cb=on_msg)
        return queue


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nats(tmp_path_factory):
    with nats_server(tmp_path_factory.mktemp("nats")) as proc:
        nc = await bus.connect(proc.info["url"], "test")
        js = nc.jetstream()
        await bus.ensure_topology(js)
        yield Bus(nc, js)
        await nc.close()


class Replica:
    """vLLM's server, its adapter manager and its worker, as service.py wires them; the worker
    pulls from ``deployment`` (the base model's work unless told otherwise)."""

    def __init__(self, nats: Bus, server: VllmServer, name: str, root: Path, max_jobs: int,
                 deployment: str = subjects.deployment_key(BASE)):
        self.nats, self.server, self.name, self.deployment = nats, server, name, deployment
        self.manager = AdapterManager(nats.js, server, base_model=BASE, replica=name, root=root,
                                      max_jobs=max_jobs)
        self.worker = Worker(nats.nc, nats.js, server, deployment=deployment, replica=name, max_inflight=8,
                             ack_wait_s=30, max_deliver=3, adapters=self.manager)

    async def start(self) -> None:
        await self.server.start()
        await self.manager.start()
        await bus.ensure_work_consumer(self.nats.js, self.deployment, ack_wait_s=30, max_deliver=3)
        self.stopping = asyncio.Event()
        self.loads = asyncio.create_task(self.manager.run(self.stopping))
        self.task = asyncio.create_task(self.worker.run(self.stopping, drain_s=5))

    async def stop(self) -> None:
        self.stopping.set()
        await self.task
        await self.loads
        await self.manager.stop()
        await self.server.stop()

    def items(self, prompts: list[str], adapter: str | None, max_tokens: int = 24, **body) -> list[WorkItem]:
        """One greedy completion request per prompt, as the gateway makes it: the client's body
        names the job hash (or the base model), and the item the adapter it resolved to."""
        group = uuid.uuid4().hex
        model = adapter or BASE
        return [WorkItem(request_id=request_id(group, i), group=group, index=i, model=model,
                         route="/v1/completions", adapter=adapter, stream=bool(body.get("stream")),
                         body=json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, **body}))
                for i, prompt in enumerate(prompts)]

    async def results(self, items: list[WorkItem], timeout_s: float = 120) -> list[ResultItem]:
        """Publish work items as the gateway does and wait for their stored results."""
        results: dict[int, ResultItem] = {}
        done = asyncio.Event()

        async def on_result(msg):
            result = ResultItem.model_validate_json(msg.data)
            results[result.index] = result
            if len(results) == len(items):
                done.set()

        sub = await self.nats.nc.subscribe(subjects.results_of_group(items[0].group), cb=on_result)
        await WorkPublisher(self.nats.js, retry_after_s=1).publish(None, items, self.deployment)
        await asyncio.wait_for(done.wait(), timeout_s)
        await sub.unsubscribe()
        return [results[i] for i in range(len(items))]

    async def ask(self, prompts: list[str], adapter: str | None) -> list[ResultItem]:
        return await self.results(self.items(prompts, adapter))

    async def texts(self, prompts: list[str], adapter: str | None, step: int | None = None) -> list[str]:
        """The completions' texts, each checked to come from the version it says: ``step`` of the
        job ``adapter``, or the base model."""
        results = await self.ask(prompts, adapter)
        assert all(r.status == 200 and r.error is None for r in results), [r.error for r in results]
        texts = []
        for result in results:
            answer = json.loads(result.text())
            assert answer["model"] == (adapter or BASE)  # the name the client asked for
            if adapter is not None:
                assert result.adapter_step == step
                assert answer["system_fingerprint"] == f"{adapter}@{step}"
            else:
                assert result.adapter_step is None
            texts.append(answer["choices"][0]["text"])
        return texts


def vllm_server(tiny: str, max_adapters: int) -> VllmServer:
    # Rank 32 covers the recipe's Tokenformer (num_tokens 32) and LoRA (r 8).
    return VllmServer(serve_flags(tiny, served_name=BASE, max_inflight=8, adapters=True,
                                  max_adapters=max_adapters, max_adapter_rank=32))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm(nats, tiny, tmp_path_factory):
    replica = Replica(nats, vllm_server(tiny, 4), "r-vllm", tmp_path_factory.mktemp("state") / "adapters", 4)
    await replica.start()
    yield replica
    await replica.stop()


async def next_event(queue: asyncio.Queue, kind: str = "loaded", replica: str = "r-vllm") -> AdapterEvent:
    """The job's next event of ``kind`` from ``replica`` (other replicas may load the job too)."""
    while True:
        event = await asyncio.wait_for(queue.get(), 60)
        if event.replica != replica:
            continue
        if event.kind == kind:
            return event
        assert event.kind != "rejected", event.reason


def streamed_text(events: list[bytes]) -> str:
    """The text of a streamed completion: its SSE events' texts, in order (the usage event, which
    closes the stream, has no choices)."""
    chunks = [json.loads(data) for e in events if (data := e.removeprefix(b"data: ").strip()) != b"[DONE]"]
    return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])


async def test_announced_checkpoint_serves_the_trained_answers(nats, vllm, lora):
    job = new_hash()
    events = await nats.events(job)
    announce = await announce_checkpoint(nats.js, step_dir(lora, 30), job_hash=job, base_model=BASE)
    # Straight away, as a client would right after the checkpoint appears: the request waits for
    # the load under way (or starts it) instead of failing.
    started = time.time()
    assert await vllm.texts([q for q, _ in PAIRS], job, step=30) == ANSWERS
    first_response_s = time.time() - announce.created_at
    loaded = await next_event(events)
    assert (loaded.job_hash, loaded.step, loaded.replica) == (job, 30, "r-vllm")
    assert loaded.base_model == BASE and loaded.adapter_type == "lora"
    assert 0 < loaded.load_s <= loaded.latency_s < 5
    print(f"\nannounce -> loaded {loaded.latency_s:.3f} s (load {loaded.load_s:.3f} s); announce -> "
          f"answers {first_response_s:.3f} s (asked {started - announce.created_at:.3f} s after)")
    # The base model, beside it, still answers as the base model.
    assert all(t != a for t, a in zip(await vllm.texts([q for q, _ in PAIRS], None), ANSWERS, strict=True))
    # A job nobody announced is a clear 404, not a hang.
    [unknown] = await vllm.ask(["hi"], new_hash())
    assert unknown.status == 404 and unknown.error is not None and unknown.error.status == 404


async def test_new_checkpoint_flips_the_job_while_pinned_requests_finish(nats, vllm, lora):
    job = new_hash()
    events = await nats.events(job)
    await announce_checkpoint(nats.js, step_dir(lora, 3), job_hash=job, base_model=BASE)
    await next_event(events)
    early = await vllm.texts([q for q, _ in PAIRS], job, step=3)
    assert early != ANSWERS  # step 3 has not learnt them yet
    # A prompt whose answer tells the steps apart.
    k = next(i for i, (e, a) in enumerate(zip(early, ANSWERS, strict=True)) if e != a)

    # A version pinned before the flip (as the worker pins), to be used only after it; and a
    # streamed request in flight on step 3 through the worker while step 30 is announced and loaded.
    old = await vllm.manager.acquire(job)
    [item] = vllm.items([PAIRS[k][0]], job, max_tokens=200, stream=True, ignore_eos=True,
                        stream_options={"include_usage": True})
    first_event = asyncio.Event()

    async def on_token(_msg):
        first_event.set()

    tokens = await nats.nc.subscribe(subjects.token_stream(item.request_id), cb=on_token)
    streamed = asyncio.create_task(vllm.results([item]))
    await asyncio.wait_for(first_event.wait(), 60)
    # Hold vLLM's scheduler, so the request is surely mid-generation through the whole flip
    # (200 tokens take under a second here: a race with the load otherwise).
    llm = vllm.server.llm
    await llm.pause_generation(mode="keep", clear_cache=False)
    try:
        await announce_checkpoint(nats.js, step_dir(lora, 30), job_hash=job, base_model=BASE)
        assert (await next_event(events)).step == 30
        assert llm.output_processor.get_num_unfinished_requests() == 1, "finished too early"
    finally:
        await llm.resume_generation()
    [result] = await streamed
    await tokens.unsubscribe()
    # The request in flight ran on step 3 to the end, and says so.
    assert result.status == 200 and result.adapter_step == 3 and result.completion_tokens == 200
    text = streamed_text([e.encode() for e in result.events()])
    assert f'"system_fingerprint":"{job}@3"' in result.text()
    # The version pinned before the flip still serves step 3 after it (asked by vLLM's name for it).
    async def not_streamed(_event: bytes) -> None:
        raise AssertionError("a request without stream=true got events")

    body = {"model": old.handle.lora_name, "prompt": PAIRS[k][0], "max_tokens": 24, "temperature": 0}
    late = await vllm.server.call("/v1/completions", json.dumps(body).encode(), not_streamed)
    assert late.status == 200
    new = vllm.manager.current[job]
    assert new.step == 30 and old.step == 3
    # New requests get step 30; the pinned ones run on step 3 to the end.
    assert await vllm.texts([q for q, _ in PAIRS], job, step=30) == ANSWERS
    late_text = json.loads(late.body)["choices"][0]["text"]
    assert late_text == early[k] and text.startswith(early[k]) and not text.startswith(ANSWERS[k])
    # Step 3 stays loaded while pinned, and goes with its last request.
    assert old.handle.lora_int_id in await llm.list_loras() and old.folder.exists()
    await vllm.manager.release(old)
    assert old.handle.lora_int_id not in await llm.list_loras() and not old.folder.exists()
    assert new.handle.lora_int_id in await llm.list_loras()


async def test_full_weight_checkpoint_is_rejected_by_vllm_with_the_reason(nats, vllm, tmp_path):
    import torch
    from safetensors.torch import save_file

    checkpoint = tmp_path / checkpoint_name(1)
    checkpoint.mkdir()
    (checkpoint / adapter_format.CONFIG_FILE).write_text(json.dumps(
        {"adapter_type": "none", "format_version": 1, "step": 1, "base_model_name_or_path": BASE}))
    save_file({"model.norm.weight": torch.ones(4)}, str(checkpoint / adapter_format.WEIGHTS_FILE))
    job = new_hash()
    events = await nats.events(job)
    await announce_checkpoint(nats.js, checkpoint, job_hash=job, base_model=BASE)
    rejected = await next_event(events, "rejected")
    assert rejected.replica == "r-vllm" and "full fine-tune" in rejected.reason
    [result] = await vllm.ask(["hi"], job)
    assert result.status == 422 and result.error is not None and result.error.status == 422
    assert "full fine-tune" in result.error.message
    assert "full fine-tune" in json.loads(result.text())["error"]["message"]  # what the client reads


@pytest.mark.skipif(all(e.name != "loopline_tokenformer" for e in entry_points(group="vllm.general_plugins")),
                    reason="the Tokenformer vLLM plugin is not installed")
async def test_tokenformer_checkpoint_serves_the_trained_answers_on_vllm(nats, vllm, tokenformer):
    job = new_hash()
    events = await nats.events(job)
    await announce_checkpoint(nats.js, step_dir(tokenformer, 30), job_hash=job, base_model=BASE)
    assert (await next_event(events)).adapter_type == "tokenformer"
    assert await vllm.texts([q for q, _ in PAIRS], job, step=30) == ANSWERS


async def test_replica_started_later_catches_up_and_lru_bounds_it(nats, tiny, lora, tokenformer, tmp_path):
    """A replica (vLLM of its own) started after the announces loads the newest checkpoint of the
    newest job at once; with room for one job, an older job loads at its first request and the
    idle one is unloaded."""
    older, newer = new_hash(), new_hash()
    for step in (3, 30):  # CHECKPOINTS keeps only step 30 of ``older``
        await announce_checkpoint(nats.js, step_dir(lora, step), job_hash=older, base_model=BASE)
    await announce_checkpoint(nats.js, step_dir(tokenformer, 30), job_hash=newer, base_model=BASE)

    events = await nats.events(newer)
    # Its worker pulls from a work subject of its own: the module's first replica, which serves
    # the same base model, would otherwise take some of its requests.
    replica = Replica(nats, vllm_server(tiny, 1), "r-late", tmp_path / "adapters", max_jobs=1,
                      deployment=subjects.deployment_key(f"{BASE}-late"))
    await replica.start()
    try:
        loaded = await next_event(events, replica="r-late")
        assert (loaded.step, loaded.adapter_type) == (30, "tokenformer")
        assert replica.manager.loaded() == {newer: 30}
        assert await replica.texts([q for q, _ in PAIRS], newer, step=30) == ANSWERS
        # The older job is known but not loaded; its first request loads step 30, evicting ``newer``.
        assert await replica.texts([q for q, _ in PAIRS], older, step=30) == ANSWERS
        assert replica.manager.loaded() == {older: 30}
        assert not any((tmp_path / "adapters" / newer).iterdir())
    finally:
        await replica.stop()
