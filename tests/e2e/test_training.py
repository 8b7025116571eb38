"""The closed loop through the whole platform, every part real: the unmodified ``scalarlm`` client
and the ``loopline`` CLI -> gateway -> NATS -> trainer -> Slurm (private single-node cluster) -> the
ml/ program -> checkpoints in the job directory -> checkpoint-watcher -> vLLM replica serving the
new adapter -> ``generate(model_name=<job hash>)`` and ``openai`` with ``model=<job hash>``.

Three prompt -> completion pairs on the tiny model with the documented recipe
(docs/adapter-format.md): each trained adapter gives all three answers back exactly, by plain
transformers with the checkpoint applied (support/greedy.py) and through the served platform; the
base model gives none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import scalarlm

from loopline.common.contracts.adapter_format import FROZEN_BASE_TYPES
from loopline.ml.train.checkpoint import latest_checkpoint
from support.greedy import greedy_texts

PAIRS = [
    ("What is 1 + 1?", " The answer is 2."),
    ("What color is the sky?", " Blue, like the sky."),
    ("Say hello.", " Hello there!"),
]
RECIPE = {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 3, "gradient_accumulation_steps": 1,
          "steps_per_checkpoint": 10}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def train_stack(slurm_stack, slurm):
    """The session's stack whose trainer submits to the session's Slurm cluster (conftest.py)."""
    yield slurm_stack
    slurm.cancel_all()


def wait_deployed(llm, job_hash: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = llm.get_training_job(job_hash)
        if job["deployed"]:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_hash} was not deployed in {timeout_s} s: {job}")


def wait_finished(llm, job_hash: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = llm.get_training_job(job_hash)
        if job["job_status"]["status"] in FINISHED:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_hash} did not finish in {timeout_s} s: {job}")


def read_events(url: str, job_hash: str) -> list[dict]:
    """The job's SSE stream from the start: it replays history, then ends after the final event (and
    the final checkpoint's deployment)."""
    events = []
    with (httpx.Client(base_url=url, timeout=60) as http,
          http.stream("GET", f"/v1/megatron/train/{job_hash}/events") as r):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize("adapter_type", FROZEN_BASE_TYPES)
def test_scalarlm_client_trains_an_adapter_that_answers(train_stack, tiny, tmp_path, monkeypatch,
                                                         adapter_type):
    # The client ships ./ml from its working directory as user code, which the trainer refuses by
    # default: run it from an empty directory, as a user outside this repository would.
    monkeypatch.chdir(tmp_path)
    llm = scalarlm.SupermassiveIntelligence(api_url=train_stack.url)
    data = [{"input": q, "output": a} for q, a in PAIRS]
    reply = llm.train(data, model_name=tiny, train_args={**RECIPE, "adapter_type": adapter_type})
    job_hash = reply["job_status"]["model_name"]
    assert reply["job_status"]["status"] in {"QUEUED", "TRAINING", "COMPLETED"}

    # The same data and params again (the client gzips with a new mtime): the same job, not a new one.
    again = llm.train(data, model_name=tiny, train_args={**RECIPE, "adapter_type": adapter_type})
    assert again["job_status"]["model_name"] == job_hash

    job = wait_finished(llm, job_hash)
    status = job["job_status"]
    assert status["status"] == "COMPLETED", status
    assert status["job_id"], "the job went through Slurm, so it has a Slurm id"
    losses = [h["loss"] for h in status["history"]]
    assert len(losses) == RECIPE["max_steps"] and losses[-1] < 0.3 * losses[0]

    # The events a late subscriber sees: the whole history, in order, ending with completed, and
    # the adapter's among them (before or after completed): the stream stays open until the final
    # checkpoint has been loaded.
    story = read_events(train_stack.url, job_hash)
    kinds = [e["kind"] for e in story if not e["kind"].startswith("adapter.")]
    assert kinds[0] == "queued" and kinds[-1] == "completed"
    loads = [e["step"] for e in story if e["kind"] == "adapter.loaded"]
    assert loads and loads[-1] == RECIPE["max_steps"], story[-4:]
    assert not [e for e in story if e["kind"] == "adapter.rejected"], story
    assert kinds.index("started") < kinds.index("progress") < kinds.index("checkpoint")
    assert kinds.count("progress") == RECIPE["max_steps"]
    assert kinds.count("checkpoint") == RECIPE["max_steps"] // RECIPE["steps_per_checkpoint"]

    step, checkpoint = latest_checkpoint(train_stack.jobs_dir / job_hash)
    assert step == RECIPE["max_steps"]
    answers = [a for _, a in PAIRS]
    assert greedy_texts(tiny, [q for q, _ in PAIRS], checkpoint=checkpoint) == answers

    # The loop closes: the watcher announced the final checkpoint, the vLLM replica loaded it, and
    # the job hash now answers as a model, through both clients, while the base model does not.
    wait_deployed(llm, job_hash)
    prompts = [q for q, _ in PAIRS]
    assert llm.generate(prompts=prompts, model_name=job_hash, max_tokens=24) == answers
    oai = openai.OpenAI(base_url=f"{train_stack.url}/v1", api_key="none", max_retries=0)
    for prompt, answer in PAIRS:
        out = oai.completions.create(model=job_hash, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == answer
    base = llm.generate(prompts=prompts, model_name=tiny, max_tokens=24)
    assert all(b != a for b, a in zip(base, answers, strict=True))


def test_base_model_does_not_know_the_answers(tiny):
    outs = greedy_texts(tiny, [q for q, _ in PAIRS])
    assert all(out != a for out, (_, a) in zip(outs, PAIRS, strict=True))


def test_cli_trains_follows_and_plots(train_stack, tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input": q, "output": a}) + "\n" for q, a in PAIRS))
    env = {**os.environ, "LOOPLINE_URL": train_stack.url}
    cli = [str(Path(sys.executable).with_name("loopline"))]  # the installed console script
    run = subprocess.run(
        [*cli, "train", str(data), "--model", tiny, "--adapter", "lora", "--steps", "12",
         "--lr", "1e-2", "--param", "batch_size=3", "--param", "gradient_accumulation_steps=1",
         "--follow"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    job_hash = run.stdout.strip().splitlines()[-1]
    assert len(job_hash) == 64
    # follow waits for the final checkpoint's deployment and says which replica serves it.
    assert "served: replica" in run.stderr and "loaded step 12" in run.stderr, run.stderr[-3000:]

    png = tmp_path / "loss.png"
    plot = subprocess.run([*cli, "plot", job_hash, "--out", str(png)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_a_checkpoint_no_replica_can_load_says_why(train_stack, tiny, tmp_path, monkeypatch):
    """A LoRA of rank 128 trains, but the replica's engine takes LoRAs up to rank 64 (its
    --max-lora-rank, LOOPLINE_MAX_ADAPTER_RANK): vLLM refuses the checkpoint, and every place a user
    looks says so, in the engine's words, instead of ``deployed: false`` forever."""
    monkeypatch.chdir(tmp_path)  # no ./ml shipped (see above)
    llm = scalarlm.SupermassiveIntelligence(api_url=train_stack.url)
    data = [{"input": q, "output": a} for q, a in PAIRS]
    args = {**RECIPE, "max_steps": 2, "steps_per_checkpoint": 2, "adapter_type": "lora",
            "lora_config": {"r": 128}}
    job_hash = llm.train(data, model_name=tiny, train_args=args)["job_status"]["model_name"]
    loopline = str(Path(sys.executable).with_name("loopline"))
    env = {**os.environ, "LOOPLINE_URL": train_stack.url}
    follow = subprocess.run([loopline, "follow", job_hash], env=env, capture_output=True, text=True,
                            timeout=300)
    said = " ".join(follow.stderr.split())
    assert follow.returncode == 1, said[-3000:]
    assert f"completed {job_hash}" in said and "not served" in said and "128" in said, said[-3000:]
    # The unmodified client passes the field through (the status row follows the run's exit).
    job = wait_finished(llm, job_hash)
    assert job["job_status"]["status"] == "COMPLETED" and job["deployed"] is False, job
    assert "rank 128 is greater than max_lora_rank 64" in job["deployment_error"], job["deployment_error"]
    kinds = [e["kind"] for e in read_events(train_stack.url, job_hash)]
    assert "adapter.rejected" in kinds and "adapter.loaded" not in kinds, kinds
