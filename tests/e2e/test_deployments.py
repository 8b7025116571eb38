"""Several deployments in one stack: ``LOOPLINE_MODEL=tiny,tiny-embed`` serves the tiny generation
model and the tiny embedding model side by side, each with its own replica and WORK subject, through
one gateway that lists both and sends each request to the deployment its ``model`` names. A route a
model's deployment does not serve is refused with the status ``vllm serve`` gives for it."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers.utils import CONFIG_NAME

from loopline.common.contracts import subjects
from loopline.inference.vllm_args import serve_flags
from loopline.ml.models.resolve import resolve_model
from support.stacks import MODELS_DIR
from support.vllm_serve import vllm_serve

pytestmark = pytest.mark.timeout(900)

CHAT, EMBED = "tiny", "tiny-embed"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def stack(two_deployments_stack):
    """CHAT and EMBED, one deployment each (conftest.py), both serving adapters (an embedding job
    trains EMBED's: test_embedding_training.py). No vLLM flag is needed: the replica's flags leave
    prefix caching to vLLM, which knows an encoder-only model has none."""
    return two_deployments_stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


def test_models_lists_both_deployments(http):
    resp = http.get("/v1/models")
    assert resp.status_code == 200, resp.text
    # Adapters (a job another test trained) are listed too, each with its base model as parent.
    assert sorted(m["id"] for m in resp.json()["data"] if m.get("parent") is None) == [CHAT, EMBED]


def test_each_deployment_has_its_own_replica_and_work_subject(http):
    replicas = http.get("/v1/health").json()["services"]["vllm"]
    assert sorted((r["model"], r["deployment"]) for r in replicas) == [
        (CHAT, subjects.deployment_key(CHAT)), (EMBED, subjects.deployment_key(EMBED))]
    assert subjects.work(subjects.deployment_key(CHAT)) != subjects.work(subjects.deployment_key(EMBED))


def test_chat_on_the_generation_model(http):
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6,
            "temperature": 0}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["model"] == CHAT and answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"]
    assert 0 < answer["usage"]["completion_tokens"] <= 6


def test_a_request_naming_no_model_goes_to_the_first(http):
    resp = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == CHAT


def test_embeddings_on_the_embedding_model(http):
    hidden_size = json.loads((resolve_model(EMBED, MODELS_DIR) / CONFIG_NAME).read_text())["hidden_size"]
    resp = http.post("/v1/embeddings", json={"model": EMBED, "input": TEXTS})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["model"] == EMBED and [d["index"] for d in answer["data"]] == [0, 1]
    vectors = [d["embedding"] for d in answer["data"]]
    assert [len(v) for v in vectors] == [hidden_size, hidden_size]
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)  # normalised, as vLLM pools
    assert vectors[0] != vectors[1]
    assert answer["usage"]["prompt_tokens"] > 0


def test_chat_on_the_embedding_model_is_refused(http):
    """vllm serve has no chat route for a pooling model: 404 (tests/ml/test_tiny_embed.py)."""
    resp = http.post("/v1/chat/completions",
                     json={"model": EMBED, "messages": [{"role": "user", "content": "Hello!"}]})
    assert resp.status_code == 404, resp.text


def test_embeddings_on_the_generation_model_are_refused_as_vllm_serve_refuses_them(http, tmp_path):
    request = {"model": CHAT, "input": TEXTS[0]}
    ours = http.post("/v1/embeddings", json=request)
    flags = serve_flags(str(resolve_model(CHAT, MODELS_DIR)), served_name=CHAT, max_inflight=8)
    with vllm_serve(flags, log_path=tmp_path / "vllm-serve.log") as url:
        theirs = httpx.post(f"{url}/v1/embeddings", json=request, timeout=60)
    assert 400 <= theirs.status_code < 500, theirs.text
    assert ours.status_code == theirs.status_code, ours.text
