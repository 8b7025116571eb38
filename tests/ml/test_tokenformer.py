"""The Tokenformer adapter: the formula, a fresh adapter is the base model, and one step changes it."""

from __future__ import annotations

import math

import pytest
import torch

from loopline.common.contracts.train_params import TokenformerParams
from loopline.ml.adapters.io import (
    adapter_config,
    adapter_tensors,
    apply_adapter,
    prepare_model,
    write_adapter,
)
from loopline.ml.adapters.tokenformer import TokenformerLinear, tokenformer_delta, tokenformer_theta
from loopline.ml.train.data import collate, tokenize
from loopline.ml.train.loop import train_step


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_delta_matches_the_written_formula():
    """Θ(x Kᵀ) V with Θ(s) = √n · GeLU(s) / ‖GeLU(s)‖₂, computed by hand, element by element."""
    g = torch.Generator().manual_seed(0)
    x, k, v = torch.randn(3, 5, generator=g), torch.randn(4, 5, generator=g), torch.randn(4, 6, generator=g)
    expected = torch.zeros(3, 6, dtype=torch.float64)
    for row in range(3):
        scores = [sum(float(x[row, j]) * float(k[t, j]) for j in range(5)) for t in range(4)]
        gelu = [s * 0.5 * (1 + math.erf(s / math.sqrt(2))) for s in scores]
        norm = math.sqrt(sum(a * a for a in gelu))
        weights = [math.sqrt(4) * a / norm for a in gelu]
        for o in range(6):
            expected[row, o] = sum(weights[t] * float(v[t, o]) for t in range(4))
    assert torch.allclose(tokenformer_delta(x, k, v).double(), expected, atol=1e-5)


def test_theta_zero_padding_and_zero_scores():
    """Zero-padded token slots change nothing once √n uses the real n (the serving-side trick)."""
    s = torch.randn(2, 7)
    padded = torch.cat([s, torch.zeros(2, 9)], dim=-1)
    rescaled = tokenformer_theta(padded)[:, :7] * math.sqrt(7 / 16)
    assert torch.allclose(rescaled, tokenformer_theta(s), atol=1e-6)
    assert torch.equal(tokenformer_theta(torch.zeros(1, 4)), torch.zeros(1, 4))  # no NaN at x = 0


def test_fresh_adapter_is_the_base_model_and_one_step_changes_it(tiny_path, tmp_path):
    base, tok = _load(tiny_path)
    model, _ = _load(tiny_path)
    ids = torch.tensor([tok.encode("What is 1 + 1? The answer is 2.")])
    with torch.no_grad():
        expected = base(ids).logits

    defaults = TokenformerParams()  # 32 tokens on all seven projections
    model, fields = prepare_model(model, "tokenformer", tokenformer=defaults.model_dump(), lora={},
                                  base_model=tiny_path, seed=0)
    assert sum(isinstance(m, TokenformerLinear) for m in model.modules()) == 2 * 7
    assert fields == {"num_tokens": 32, "target_modules": sorted(defaults.target_modules)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == {
        "tokenformer_k", "tokenformer_v"}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)  # exactly, not approximately

    model.train()
    row = {"input": "What is 1 + 1?", "output": " The answer is 2."}
    batch = collate([tokenize(tok, row, tok.eos_token_id, 64)], tok.pad_token_id)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    result = train_step(model, [batch], optimizer, trainable, 1.0, torch.device("cpu"))
    assert result.applied and math.isfinite(result.loss)
    model.eval()
    with torch.no_grad():
        after = model(ids).logits
    assert (after - expected).abs().max() > 1e-4
    # Only the adapter moved: every base tensor is still the base model's.
    tuned = dict(model.named_parameters())
    assert all(torch.equal(p, tuned[name]) for name, p in base.named_parameters())

    # Saved and applied to a fresh base model, the adapter gives the same logits.
    config = adapter_config(model, "tokenformer", base_model=tiny_path, extra=fields)
    write_adapter(tmp_path, config, adapter_tensors(model, "tokenformer"))
    with torch.no_grad():
        assert torch.equal(apply_adapter(_load(tiny_path)[0], tmp_path)(ids).logits, after)


def test_unknown_target_modules_fail(tiny_path):
    model, _ = _load(tiny_path)
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        prepare_model(model, "tokenformer", tokenformer={"num_tokens": 4, "target_modules": ["nope"]},
                      lora={}, base_model=tiny_path, seed=0)
