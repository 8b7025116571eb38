"""Checkpoint kinds as inference loads them: full weights ("none"), PEFT-compatible LoRA, SmolLM2."""

from __future__ import annotations

import warnings

import pytest
import torch

from loopline.ml.adapters import apply_adapter, read_adapter_config
from loopline.ml.adapters.io import read_tensors
from loopline.ml.models.resolve import ModelNotFoundError, resolve_model
from loopline.ml.train.checkpoint import latest_checkpoint, load_training_state
from support.stacks import MODELS_DIR

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _train(jobs, name, params, model=None):
    job = jobs.write(name, params, model=model)
    run = jobs.run(job)
    assert run.returncode == 0, run.stderr[-3000:]
    return job, latest_checkpoint(job)[1]


def test_full_finetune_checkpoints_every_weight(jobs):
    _, checkpoint = _train(jobs, "none", {**jobs.recipe, "max_steps": 3, "adapter_type": "none"})
    assert read_adapter_config(checkpoint)["adapter_type"] == "none"
    tensors = read_tensors(checkpoint)
    base = _base(jobs.model)
    # Every parameter, each once: the tied lm_head is the embedding and is not stored twice.
    assert sorted(tensors) == sorted(name for name, _ in base.named_parameters())
    assert "lm_head.weight" not in tensors and base.config.tie_word_embeddings
    changed = [n for n, p in base.named_parameters() if not torch.equal(p, tensors[n])]
    assert len(changed) == len(tensors)  # full fine-tuning moved every tensor

    state = load_training_state(checkpoint)
    assert {"optimizer", "scheduler", "step", "data_cursor", "rng", "skipped_steps"} <= state.keys()
    assert state["step"] == 3 and state["data_cursor"] == {"epoch": 3, "position": 0}

    ids = torch.tensor([[5, 17, 99, 300, 12]])
    before = _logits(base, ids)
    tuned = apply_adapter(base, checkpoint)
    assert not tuned.training
    assert all(torch.equal(p, tensors[n]) for n, p in tuned.named_parameters())
    assert torch.equal(tuned.lm_head.weight, tensors["model.embed_tokens.weight"])  # tying survives
    assert (_logits(tuned, ids) - before).abs().max() > 1e-3


def test_lora_checkpoint_is_a_peft_adapter(jobs):
    from peft import PeftModel

    _, checkpoint = _train(jobs, "lora", {**jobs.recipe, "max_steps": 3, "adapter_type": "lora"})
    config = read_adapter_config(checkpoint)
    assert config["adapter_type"] == "lora" and config["peft_type"] == "LORA" and config["r"] == 8
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in read_tensors(checkpoint))
    assert any(k.startswith("base_model.model.model.layers.0.") for k in read_tensors(checkpoint))

    ids = torch.tensor([[5, 17, 99, 300, 12]])
    base_logits = _logits(_base(jobs.model), ids)
    # PEFT's own loader reads our folder as it is (keys, config) and agrees with ours.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PEFT notes our extra fields (adapter_type...)
        peft_logits = _logits(PeftModel.from_pretrained(_base(jobs.model), checkpoint).eval(), ids)
    unmerged = _logits(apply_adapter(_base(jobs.model), checkpoint, merge_lora=False), ids)
    merged = _logits(apply_adapter(_base(jobs.model), checkpoint), ids)
    assert torch.equal(unmerged, peft_logits)
    assert torch.allclose(merged, peft_logits, atol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-3


@pytest.mark.smollm2
def test_smollm2_lora_loss_goes_down(jobs):
    try:
        model = str(resolve_model(SMOLLM2, MODELS_DIR))
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")
    params = {"max_steps": 6, "adapter_type": "lora", "learning_rate": 1e-3, "lr_decay": "constant",
              "batch_size": 3, "gradient_accumulation_steps": 1, "max_seq_len": 64}
    job, checkpoint = _train(jobs, "smollm2", params, model=model)
    losses = [p["loss"] for p in jobs.status(job)["history"]]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0]
    assert read_adapter_config(checkpoint)["base_model_name_or_path"] == model
