"""What a training client saves: an adapter PEFT loads as it is, and a state (adapter, LoraSpec,
optimizer) that loads back into the same or a new client."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tinker.types import AdamParams

from loopline.common.contracts.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loopline.common.contracts.tinker_names import LORA_FILE, OPTIMIZER_FILE
from loopline.common.contracts.tinker_schemas import LoraSpec
from loopline.ml.adapters.io import apply_adapter, read_adapter_config
from loopline.tinker_worker.types import UserError
from support.tinker_data import inputs_of, tokens_of

SPEC = LoraSpec(rank=8, seed=5)  # attention, MLP and lm_head (the tied unembedding)
STEP = AdamParams(learning_rate=1e-2)


def _logprobs(clients, model_id, data) -> list[np.ndarray]:
    return [o["logprobs"] for o in clients.forward_backward(model_id, data, "cross_entropy",
                                                            forward_only=True).outputs]


def _trained(clients, new_id, data, spec=SPEC, steps=3) -> str:
    model = new_id()
    clients.create(model, spec)
    for _ in range(steps):
        clients.forward_backward(model, data, "cross_entropy")
        clients.optim_step(model, STEP)
    return model


# PEFT warns about any adapter on a tied layer (peft#2777: merging or non-safetensors exports);
# a LoRA on lm_head leaves the tied weight itself alone.
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_saved_adapter_is_a_peft_lora_with_the_same_logprobs(clients, new_id, sft_data, tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _trained(clients, new_id, sft_data)
    clients.save_adapter(model, tmp_path, base_model=tiny_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    config = read_adapter_config(tmp_path)
    assert config["adapter_type"] == "lora" and config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 32, tiny_path)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj", "lm_head"])
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    peft = apply_adapter(base, tmp_path, merge_lora=False)  # PEFT's LoRA forward, as vLLM computes it
    ours = _logprobs(clients, model, sft_data)
    for datum, logprobs in zip(sft_data, ours, strict=True):
        with torch.no_grad():
            logits = peft(torch.tensor([tokens_of(datum)])).logits[0]
        targets = torch.from_numpy(inputs_of(datum)["target_tokens"])[:, None]
        expected = torch.log_softmax(logits, -1).gather(1, targets)[:, 0]
        np.testing.assert_allclose(logprobs, expected, atol=1e-4)


def test_state_round_trips_with_its_optimizer(clients, new_id, sft_data, tmp_path):
    model = _trained(clients, new_id, sft_data)
    clients.save_state(model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, LORA_FILE, OPTIMIZER_FILE}
    assert LoraSpec.model_validate_json((tmp_path / LORA_FILE).read_text()) == SPEC

    with_adam, without_adam = new_id(), new_id()
    clients.load_state(with_adam, tmp_path, with_optimizer=True, lora=None)
    clients.load_state(without_adam, tmp_path, with_optimizer=False, lora=None)
    assert clients.step_count(with_adam) == 3 and clients.step_count(without_adam) == 0
    saved = _logprobs(clients, model, sft_data)
    for loaded in (with_adam, without_adam):
        for a, b in zip(saved, _logprobs(clients, loaded, sft_data), strict=True):
            np.testing.assert_array_equal(a, b)

    # One more step on each: only restored Adam moments take the original's step exactly.
    for m in (model, with_adam, without_adam):
        clients.forward_backward(m, sft_data, "cross_entropy")
        clients.optim_step(m, STEP)
    after = _logprobs(clients, model, sft_data)
    for a, b in zip(after, _logprobs(clients, with_adam, sft_data), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert not np.allclose(after[0], _logprobs(clients, without_adam, sft_data)[0], atol=1e-4)


def test_loading_into_an_existing_client_replaces_its_weights(clients, new_id, sft_data, tmp_path):
    source = _trained(clients, new_id, sft_data, steps=2)
    clients.save_state(source, tmp_path)
    target = _trained(clients, new_id, sft_data[:1], steps=5)
    clients.forward_backward(target, sft_data, "cross_entropy")  # pending gradients: dropped by the load
    clients.load_state(target, tmp_path, with_optimizer=False)
    assert clients.step_count(target) == 5
    assert clients.optim_step(target, STEP)["grad_norm:mean"] == 0.0
    clients.load_state(target, tmp_path, with_optimizer=True)
    assert clients.step_count(target) == 2
    for a, b in zip(_logprobs(clients, source, sft_data), _logprobs(clients, target, sft_data), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_sampler_save_loads_without_optimizer(clients, new_id, sft_data, tiny_path, tmp_path):
    """A sampler save is the adapter alone: its LoraSpec comes from the adapter config."""
    spec = LoraSpec(rank=4, seed=1, train_mlp=False, train_unembed=False)
    model = _trained(clients, new_id, sft_data, spec=spec, steps=2)
    clients.save_adapter(model, tmp_path, base_model=tiny_path)
    loaded = new_id()
    with pytest.raises(UserError, match="no optimizer state"):
        clients.load_state(loaded, tmp_path, with_optimizer=True)
    assert loaded not in clients.models()  # a refused load creates nothing
    clients.load_state(loaded, tmp_path, with_optimizer=False)
    for a, b in zip(_logprobs(clients, model, sft_data), _logprobs(clients, loaded, sft_data), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_that_does_not_fit_is_refused(clients, new_id, sft_data, tmp_path):
    model = _trained(clients, new_id, sft_data, steps=1)
    clients.save_state(model, tmp_path)
    other = new_id()
    clients.create(other, LoraSpec(rank=16, seed=5))
    before = _logprobs(clients, other, sft_data)
    with pytest.raises(UserError, match="cannot be loaded into it"):
        clients.load_state(other, tmp_path, with_optimizer=True)
    np.testing.assert_array_equal(before[0], _logprobs(clients, other, sft_data)[0])
    with pytest.raises(UserError, match="no checkpoint folder"):
        clients.load_state(new_id(), tmp_path / "absent", with_optimizer=False)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    (tmp_path / LORA_FILE).unlink()
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(UserError, match="shape"):
        clients.load_state(new_id(), tmp_path, with_optimizer=False)
