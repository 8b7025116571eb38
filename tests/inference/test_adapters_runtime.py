"""Run-time adapters in one replica: checkpoints announced on CHECKPOINTS (as the checkpoint-watcher
does) are downloaded from the object store, loaded as new versions and served by job hash.

Real parts: nats-server, the vLLM engine (and the reference engine) on the tiny model, the
replica's worker, and LoRA / Tokenformer adapters trained by ``python -m loopline.ml.train`` with
the documented recipe, which answers its three pairs exactly.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import pytest_asyncio

from loopline.common import adapter_format, bus, subjects
from loopline.common.job_layout import CHECKPOINTS_DIR, CONFIG_FILE, DATASET_FILE, checkpoint_name
from loopline.common.job_schemas import AdapterEvent
from loopline.common.schemas import ResultItem, SamplingParams, WorkItem
from loopline.gateway.submit import request_id
from loopline.gateway.work import WorkPublisher
from loopline.inference.adapters import AdapterManager
from loopline.inference.engine import GenerationRequest, Sampling, vllm_available
from loopline.inference.prompts import PromptBuilder
from loopline.inference.worker import Worker
from support.checkpoints import announce_checkpoint
from support.nats import nats_server
from support.stacks import tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="module")
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

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
    """An engine, its adapter manager and its worker, as service.py wires them."""

    def __init__(self, nats: Bus, engine, name: str, base: str, root: Path, max_jobs: int):
        self.nats, self.engine, self.name, self.base = nats, engine, name, base
        self.manager = AdapterManager(nats.js, engine, base_model=base, replica=name, root=root,
                                      max_jobs=max_jobs)
        self.deployment = subjects.deployment_key(base)

    async def start(self, tokenizer, *, worker: bool = True) -> None:
        self.prompts = PromptBuilder(tokenizer, self.engine.info.max_model_len)
        await self.manager.start()
        self.stopping = asyncio.Event()
        self.loads = asyncio.create_task(self.manager.run(self.stopping))
        self.task = None
        if not worker:
            return
        await bus.ensure_work_consumer(self.nats.js, self.deployment, ack_wait_s=30, max_deliver=3)
        self.worker = Worker(self.nats.nc, self.nats.js, self.engine, self.prompts,
                             deployment=self.deployment, replica=self.name, max_inflight=8,
                             ack_wait_s=30, max_deliver=3, adapters=self.manager)
        self.task = asyncio.create_task(self.worker.run(self.stopping, drain_s=5))

    async def stop(self) -> None:
        self.stopping.set()
        if self.task is not None:
            await self.task
        await self.loads
        await self.manager.stop()
        await self.engine.stop()

    async def ask(self, prompts: list[str], adapter: str | None, max_tokens: int = 24) -> list[ResultItem]:
        """Publish work items as the gateway does and wait for their results."""
        group = uuid.uuid4().hex
        results: dict[int, ResultItem] = {}
        done = asyncio.Event()

        async def on_result(msg):
            result = ResultItem.model_validate_json(msg.data)
            results[result.index] = result
            if len(results) == len(prompts):
                done.set()

        sub = await self.nats.nc.subscribe(subjects.results_of_group(group), cb=on_result)
        items = [WorkItem(request_id=request_id(group, i), group=group, index=i, model=adapter or self.base,
                          prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens), adapter=adapter)
                 for i, prompt in enumerate(prompts)]
        await WorkPublisher(self.nats.js, retry_after_s=1).publish(None, items, self.deployment)
        await asyncio.wait_for(done.wait(), 60)
        await sub.unsubscribe()
        return [results[i] for i in range(len(prompts))]

    async def texts(self, prompts: list[str], adapter: str | None) -> list[str]:
        results = await self.ask(prompts, adapter)
        assert all(r.error is None for r in results), [r.error for r in results]
        return [r.choices[0].text for r in results]

    async def direct_texts(self, prompts: list[str], job: str) -> list[str]:
        """Generate as the worker does (pin, generate, release) without going through WORK."""
        texts = []
        for prompt in prompts:
            version = await self.manager.acquire(job)
            try:
                ids = self.prompts.tokenizer.encode(prompt)
                texts.append("".join([d.text async for d in generate(self.engine, ids, version.handle)]))
            finally:
                await self.manager.release(version)
        return texts


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm(nats, tiny, tmp_path_factory):
    from transformers import AutoTokenizer

    from loopline.inference.vllm_engine import VllmEngine

    engine = VllmEngine(tiny, max_model_len=None, max_num_seqs=8, dtype="auto", enable_lora=True,
                        max_loras=4, max_lora_rank=32)
    await engine.start()
    replica = Replica(nats, engine, "r-vllm", tiny, tmp_path_factory.mktemp("state") / "adapters", 4)
    await replica.start(AutoTokenizer.from_pretrained(tiny))
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


async def generate(engine, tokenizer_ids: list[int], handle, max_tokens: int = 24):
    """Stream one greedy generation with an adapter version's handle."""
    request = GenerationRequest(uuid.uuid4().hex, tokenizer_ids, Sampling(max_tokens=max_tokens),
                                adapter=handle)
    async for delta in engine.generate(request):
        yield delta


@needs_vllm
async def test_announced_checkpoint_serves_the_trained_answers(nats, vllm, lora):
    job = new_hash()
    events = await nats.events(job)
    announce = await announce_checkpoint(nats.js, step_dir(lora, 30), job_hash=job, base_model=vllm.base)
    # Straight away, as a client would right after the checkpoint appears: the request waits for
    # the load under way (or starts it) instead of failing.
    started = time.time()
    assert await vllm.texts([q for q, _ in PAIRS], job) == ANSWERS
    first_response_s = time.time() - announce.created_at
    loaded = await next_event(events)
    assert (loaded.job_hash, loaded.step, loaded.replica) == (job, 30, "r-vllm")
    assert loaded.base_model == vllm.base and loaded.adapter_type == "lora"
    assert 0 < loaded.load_s <= loaded.latency_s < 5
    print(f"\nannounce -> loaded {loaded.latency_s:.3f} s (load {loaded.load_s:.3f} s); announce -> "
          f"answers {first_response_s:.3f} s (asked {started - announce.created_at:.3f} s after)")
    # The base model, beside it, still answers as the base model.
    assert all(t != a for t, a in zip(await vllm.texts([q for q, _ in PAIRS], None), ANSWERS, strict=True))
    # A job nobody announced is a clear 404, not a hang.
    [unknown] = await vllm.ask(["hi"], new_hash())
    assert unknown.error is not None and unknown.error.status == 404


@needs_vllm
async def test_new_checkpoint_flips_the_job_while_pinned_requests_finish(nats, vllm, lora):
    job = new_hash()
    events = await nats.events(job)
    await announce_checkpoint(nats.js, step_dir(lora, 3), job_hash=job, base_model=vllm.base)
    await next_event(events)
    early = await vllm.texts([q for q, _ in PAIRS], job)
    assert early != ANSWERS  # step 3 has not learnt them yet

    # A request in flight on step 3 (pinned as the worker pins, streaming) when step 30 is
    # announced and loaded; a second one pinned before the flip starts only after it.
    old = await vllm.manager.acquire(job)
    old_again = await vllm.manager.acquire(job)
    ids = vllm.prompts.tokenizer.encode(PAIRS[0][0])
    stream = generate(vllm.engine, ids, old.handle, max_tokens=80)
    text = (await anext(stream)).text
    await announce_checkpoint(nats.js, step_dir(lora, 30), job_hash=job, base_model=vllm.base)
    assert (await next_event(events)).step == 30
    assert vllm.engine.llm.output_processor.get_num_unfinished_requests() == 1, "finished too early"
    async for delta in stream:
        text += delta.text
    late = "".join([d.text async for d in generate(vllm.engine, ids, old_again.handle)])
    new = vllm.manager.current[job]
    assert new.step == 30 and old.step == 3
    # New requests get step 30; the pinned ones run on step 3 to the end.
    assert await vllm.texts([q for q, _ in PAIRS], job) == ANSWERS
    assert late == early[0] and text.startswith(early[0]) and text != ANSWERS[0]
    await vllm.manager.release(old_again)
    # Step 3 stays loaded while pinned, and goes with its last request.
    assert old.handle.lora_int_id in await vllm.engine.llm.list_loras() and old.folder.exists()
    await vllm.manager.release(old)
    assert old.handle.lora_int_id not in await vllm.engine.llm.list_loras() and not old.folder.exists()
    assert new.handle.lora_int_id in await vllm.engine.llm.list_loras()


@needs_vllm
async def test_full_weight_checkpoint_is_rejected_by_vllm_with_the_reason(nats, vllm, tmp_path):
    import torch
    from safetensors.torch import save_file

    checkpoint = tmp_path / checkpoint_name(1)
    checkpoint.mkdir()
    (checkpoint / adapter_format.CONFIG_FILE).write_text(json.dumps(
        {"adapter_type": "none", "format_version": 1, "step": 1, "base_model_name_or_path": vllm.base}))
    save_file({"model.norm.weight": torch.ones(4)}, str(checkpoint / adapter_format.WEIGHTS_FILE))
    job = new_hash()
    events = await nats.events(job)
    await announce_checkpoint(nats.js, checkpoint, job_hash=job, base_model=vllm.base)
    rejected = await next_event(events, "rejected")
    assert rejected.replica == "r-vllm" and "full fine-tune" in rejected.reason
    [result] = await vllm.ask(["hi"], job)
    assert result.error is not None and result.error.status == 422
    assert "full fine-tune" in result.error.message


@needs_vllm
@pytest.mark.skipif(all(e.name != "loopline_tokenformer" for e in entry_points(group="vllm.general_plugins")),
                    reason="the Tokenformer vLLM plugin is not installed")
async def test_tokenformer_checkpoint_serves_the_trained_answers_on_vllm(nats, vllm, tokenformer):
    job = new_hash()
    events = await nats.events(job)
    await announce_checkpoint(nats.js, step_dir(tokenformer, 30), job_hash=job, base_model=vllm.base)
    assert (await next_event(events)).adapter_type == "tokenformer"
    assert await vllm.texts([q for q, _ in PAIRS], job) == ANSWERS


async def test_replica_started_later_catches_up_and_lru_bounds_it(nats, tiny, lora, tokenformer, tmp_path):
    """A reference-engine replica started after the announces loads the newest checkpoint of the
    newest job at once; with room for one job, an older job loads at its first request and the
    idle one is unloaded."""
    from loopline.inference.reference_engine import ReferenceEngine

    older, newer = new_hash(), new_hash()
    for step in (3, 30):  # CHECKPOINTS keeps only step 30 of ``older``
        await announce_checkpoint(nats.js, step_dir(lora, step), job_hash=older, base_model=tiny)
    await announce_checkpoint(nats.js, step_dir(tokenformer, 30), job_hash=newer, base_model=tiny)

    events = await nats.events(newer)
    engine = ReferenceEngine(tiny, max_model_len=None, dtype="float32")
    await engine.start()
    replica = Replica(nats, engine, "r-late", tiny, tmp_path / "adapters", max_jobs=1)
    # No worker: the vLLM replica of this module shares the deployment's work.
    await replica.start(engine.tokenizer, worker=False)
    try:
        loaded = await next_event(events, replica="r-late")
        assert (loaded.step, loaded.adapter_type) == (30, "tokenformer")
        assert replica.manager.loaded() == {newer: 30}
        assert await replica.direct_texts([q for q, _ in PAIRS], newer) == ANSWERS
        # The older job is known but not loaded; its first request loads step 30, evicting ``newer``.
        assert await replica.direct_texts([q for q, _ in PAIRS], older) == ANSWERS
        assert replica.manager.loaded() == {older: 30}
        assert not any((tmp_path / "adapters" / newer).iterdir())
    finally:
        await replica.stop()
