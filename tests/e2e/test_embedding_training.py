"""ScalarLM's embedding training, closed through the platform: the unmodified ``scalarlm`` client
submits ``training_mode: "embedding"`` sentence pairs for the tiny embedding model (``tiny-embed``,
a BERT served by vLLM as a pooling model), the training program trains a LoRA that pulls each pair's
cosine toward its score, the embedding deployment's replica loads it, and ``/v1/embeddings`` with
``model: <job hash>`` answers with the trained model's vectors.

Shares the two-deployments stack (conftest.py), whose embedding deployment serves adapters.
"""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest
import scalarlm
import torch

from loopline.common.contracts.training_archive import deterministic_tar
from loopline.ml.adapters.io import apply_adapter
from loopline.ml.models.resolve import resolve_model
from loopline.ml.train.checkpoint import latest_checkpoint
from loopline.ml.train.embedding import load_embedding_model
from support.stacks import MODELS_DIR

pytestmark = pytest.mark.timeout(600)

CHAT, EMBED = "tiny", "tiny-embed"
# Scores in [0, 1], as sentence-transformers' STS data (ScalarLM's embedding mode) has them. The
# random tiny BERT gives every pair a cosine of 1.000 (its CLS vector hardly depends on the text).
PAIRS = [
    ("A man is playing a guitar.", "A person plays music on a guitar.", 0.9),
    ("A cat sleeps on the sofa.", "The stock market fell sharply today.", 0.0),
    ("Children are playing in the park.", "Kids play outside in a park.", 0.8),
    ("The chef is cooking pasta.", "A rocket launched into space.", 0.1),
    ("She is reading a book.", "A woman reads a novel.", 0.7),
    ("It is raining heavily.", "The weather is sunny and dry.", 0.3),
]
# Measured in-process over seeds 0-3 (tests/ml/test_train_embedding.py): the mean absolute error of
# the pairs' cosines to their scores falls from 0.533 to 0.11-0.19 (seed 0: 0.108), in ~1.5 s.
RECIPE = {"training_mode": "embedding", "adapter_type": "lora", "max_steps": 150, "learning_rate": 5e-3,
          "batch_size": len(PAIRS), "gradient_accumulation_steps": 1, "steps_per_checkpoint": 150}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def stack(two_deployments_stack):
    return two_deployments_stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


def wait_for(llm, job_hash: str, done, what: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = llm.get_training_job(job_hash)
        if done(job):
            return job
        time.sleep(0.25)
    raise AssertionError(f"job {job_hash} was not {what} in {timeout_s} s: {job}")


def served_cosines(http, model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' cosine similarities from /v1/embeddings on ``model``, and the vectors."""
    texts = [s for a, b, _ in PAIRS for s in (a, b)]
    resp = http.post("/v1/embeddings", json={"model": model, "input": texts})
    assert resp.status_code == 200, resp.text
    vectors = torch.tensor([d["embedding"] for d in resp.json()["data"]])
    first, second = vectors[0::2], vectors[1::2]  # normalised by vLLM: the dot product is the cosine
    return (first * second).sum(dim=-1), vectors


def mean_abs_error(cosines: torch.Tensor) -> float:
    return float((cosines - torch.tensor([s for *_, s in PAIRS])).abs().mean())


def test_an_embedding_job_is_served_by_its_hash_with_the_trained_vectors(stack, http, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./ml for the client to ship as user code
    llm = scalarlm.SupermassiveIntelligence(api_url=stack.url)
    data = [{"sentence1": a, "sentence2": b, "score": s} for a, b, s in PAIRS]
    reply = llm.train(data, model_name=EMBED, train_args=RECIPE)
    job_hash = reply["job_status"]["model_name"]
    job = wait_for(llm, job_hash, lambda j: j["job_status"]["status"] in FINISHED, "finished", 240)
    assert job["job_status"]["status"] == "COMPLETED", job["job_status"]
    wait_for(llm, job_hash, lambda j: j["deployed"], "deployed", 60)

    base_cosines, _ = served_cosines(http, EMBED)
    trained_cosines, vectors = served_cosines(http, job_hash)
    before, after = mean_abs_error(base_cosines), mean_abs_error(trained_cosines)
    print(f"cosines base {base_cosines.tolist()} (MAE {before:.3f}), trained {trained_cosines.tolist()} "
          f"(MAE {after:.3f})")
    assert after < 0.5 * before, (before, after)

    # The vectors are the checkpoint's: transformers + PEFT (unmerged, W x + B A x as vLLM computes
    # it), pooled and normalised as vLLM pools, on the job's newest checkpoint.
    _, checkpoint = latest_checkpoint(stack.jobs_dir / job_hash)
    model_path = str(resolve_model(EMBED, MODELS_DIR))
    model = apply_adapter(load_embedding_model(model_path, torch.device("cpu"), torch.float32), checkpoint,
                          merge_lora=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    texts = [s for a, b, _ in PAIRS for s in (a, b)]
    with torch.no_grad():
        reference = torch.cat([torch.nn.functional.normalize(
            model(**tokenizer(t, return_tensors="pt")).last_hidden_state[:, 0], dim=-1) for t in texts])
    assert float((vectors - reference).abs().max()) < 1e-4


def _submit(http, params: dict, rows: list[dict]) -> httpx.Response:
    dataset = "".join(json.dumps(r) + "\n" for r in rows).encode()
    archive = deterministic_tar({"dataset.jsonlines": (dataset, False)})
    return http.post("/v1/megatron/train", files={"file": ("dataset", io.BytesIO(archive))},
                     data={"params": json.dumps(params)})


@pytest.mark.parametrize(("llm_name", "mode", "says"), [
    (CHAT, "embedding", "'tiny' is a generative model"),
    (EMBED, "language_model", "'tiny-embed' is a pooling (embedding) model"),
])
def test_a_job_its_base_model_could_not_serve_is_refused_at_submission(http, llm_name, mode, says):
    rows = ([{"sentence1": "a", "sentence2": "b", "score": 0.5}] if mode == "embedding"
            else [{"input": "a", "output": "b"}])
    resp = _submit(http, {"llm_name": llm_name, "training_mode": mode, "max_steps": 1}, rows)
    assert resp.status_code == 422, resp.text
    assert says in resp.text and "params.training_mode" in resp.text


@pytest.mark.parametrize(("row", "says"), [
    ({"input": "a", "output": "b"}, "'sentence1' is missing"),
    ({"sentence1": "a", "sentence2": "b"}, "'score' is missing"),
    ({"sentence1": "a", "sentence2": "b", "score": "high"}, "'score' must be a number"),
    ({"sentence1": "a", "sentence2": "b", "score": 5}, "'score' is out of range"),
])
def test_an_embedding_row_that_is_not_a_scored_pair_is_refused(http, row, says):
    resp = _submit(http, {"llm_name": EMBED, "training_mode": "embedding", "max_steps": 1}, [row])
    assert resp.status_code == 422, resp.text
    assert says in resp.text
