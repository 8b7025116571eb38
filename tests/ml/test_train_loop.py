"""Pieces of the loop: the learning-rate schedule, skipping non-finite steps, history thinning."""

from __future__ import annotations

import math

import pytest
import torch

from loopline.common.contracts.train_params import TrainParams
from loopline.ml.adapters.io import prepare_model
from loopline.ml.train.data import collate, tokenize
from loopline.ml.train.loop import lr_factor, train_step
from loopline.ml.train.status import HISTORY_LIMIT, thin


def test_lr_schedule_warmup_then_decay():
    linear = TrainParams(max_steps=10, warmup_steps=2)
    assert [lr_factor(s, linear) for s in range(4)] == [0.5, 1.0, 1.0, 0.875]
    assert lr_factor(9, linear) == pytest.approx(0.125) and lr_factor(10, linear) == 0.0
    cosine = TrainParams(max_steps=10, lr_decay="cosine")
    assert lr_factor(0, cosine) == 1.0 and lr_factor(5, cosine) == pytest.approx(0.5)
    assert 0 < lr_factor(9, cosine) < 0.03
    constant = TrainParams(max_steps=10, lr_decay="constant", warmup_steps=4)
    assert [lr_factor(s, constant) for s in (0, 3, 4, 9)] == [0.25, 1.0, 1.0, 1.0]


def test_non_finite_step_is_skipped(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    model, _ = prepare_model(base, "tokenformer", tokenformer={"num_tokens": 4, "target_modules": ["o_proj"]},
                             lora={}, base_model=tiny_path, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    example = tokenize(tok, {"input": "Hi", "output": " there"}, tok.eos_token_id, 32)
    batch = collate([example], tok.pad_token_id)
    with torch.no_grad():
        params[1][0, 0] = math.inf  # a V entry: the logits overflow
    before = [p.detach().clone() for p in params]
    result = train_step(model, [batch], optimizer, params, 1.0, torch.device("cpu"))
    assert not result.applied and not math.isfinite(result.loss)
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert all(p.grad is None for p in params)
    assert optimizer.state == {} or all(not s for s in optimizer.state.values())


def test_history_is_thinned_keeping_the_newest():
    points = [{"step": i} for i in range(1, 2000)]
    thinned = thin(points)
    assert len(thinned) <= HISTORY_LIMIT and thinned[-1] == {"step": 1999} and thinned[0]["step"] <= 2
    assert thin(points[:HISTORY_LIMIT]) == points[:HISTORY_LIMIT]
