"""Training clients on the real tiny model: the loss and logprobs they report, how gradients
accumulate and stay apart between clients, and that AdamW steps learn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker.types import AdamParams, Datum

from loopline.common.contracts.tinker_schemas import LoraSpec
from loopline.tinker_worker.batching import micro_batches
from loopline.tinker_worker.types import UserError
from support.tinker_data import inputs_of, make_datum, tokens_of

SPEC = LoraSpec(rank=8, seed=3)


def _logprobs(clients, model_id, data) -> list[np.ndarray]:
    return [o["logprobs"] for o in clients.forward_backward(model_id, data, "cross_entropy",
                                                            forward_only=True).outputs]


def _base_logprobs(tiny_path, datum: Datum) -> np.ndarray:
    """From a separately loaded plain HF model: log_softmax of the logits at the targets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens_of(datum)])).logits[0]
    targets = torch.from_numpy(inputs_of(datum)["target_tokens"])
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0].numpy()


def test_cross_entropy_of_a_fresh_adapter_is_the_base_models(clients, new_id, sft_data, tiny_path):
    model = new_id()
    clients.create(model, SPEC)
    result = clients.forward_backward(model, sft_data, "cross_entropy", forward_only=True)
    expected = 0.0
    for datum, output in zip(sft_data, result.outputs, strict=True):
        base = _base_logprobs(tiny_path, datum)
        assert output["logprobs"].dtype == np.float32 and output["logprobs"].shape == base.shape
        np.testing.assert_allclose(output["logprobs"], base, atol=1e-4)
        expected += float(-(base * inputs_of(datum)["weights"]).sum())
    assert set(result.metrics) == {"loss:sum"}
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    # No weights at all means weight 1 on every token.
    unweighted = [make_datum(tokens_of(d), {"target_tokens": inputs_of(d)["target_tokens"]})
                  for d in sft_data]
    total = clients.forward_backward(model, unweighted, "cross_entropy", forward_only=True)
    every_token = -sum(float(o["logprobs"].sum()) for o in result.outputs)
    assert total.metrics["loss:sum"] == pytest.approx(every_token, rel=1e-5)


def test_zero_weights_give_zero_loss_and_no_update(clients, new_id, sft_data):
    model = new_id()
    clients.create(model, SPEC)
    before = _logprobs(clients, model, sft_data)
    zero = [make_datum(tokens_of(d), {**inputs_of(d), "weights": np.zeros_like(inputs_of(d)["weights"])})
            for d in sft_data]
    assert clients.forward_backward(model, zero, "cross_entropy").metrics["loss:sum"] == 0.0
    metrics = clients.optim_step(model, AdamParams(learning_rate=1e-2))
    assert metrics["grad_norm:mean"] == 0.0
    assert all(key.count(":") == 1 for key in metrics)
    for a, b in zip(before, _logprobs(clients, model, sft_data), strict=True):
        np.testing.assert_array_equal(a, b)


def test_forward_only_leaves_no_gradient(clients, new_id, sft_data):
    model = new_id()
    clients.create(model, SPEC)
    clients.forward_backward(model, sft_data, "cross_entropy", forward_only=True)
    assert clients.optim_step(model, AdamParams(learning_rate=1e-2))["grad_norm:mean"] == 0.0
    assert clients.step_count(model) == 1


def test_gradients_accumulate_until_the_step(clients, new_id, sft_data):
    halves, whole = new_id(), new_id()
    for model in (halves, whole):
        clients.create(model, SPEC)
    clients.forward_backward(halves, sft_data[:1], "cross_entropy")
    clients.forward_backward(halves, sft_data[1:], "cross_entropy")
    clients.forward_backward(whole, sft_data, "cross_entropy")
    # A small rate: Adam's first step is about lr * sign(g), so a near-zero gradient element whose
    # sign differs by rounding moves by at most 2 lr.
    norms = [clients.optim_step(m, AdamParams(learning_rate=1e-4))["grad_norm:mean"] for m in (halves, whole)]
    assert norms[0] > 1.0 and norms[0] == pytest.approx(norms[1], rel=1e-5)
    for a, b in zip(_logprobs(clients, halves, sft_data), _logprobs(clients, whole, sft_data), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_interleaved_clients_keep_their_own_gradients(clients, new_id, sft_data):
    a, b, alone_a, alone_b = (new_id() for _ in range(4))
    for model in (a, b, alone_a, alone_b):
        clients.create(model, SPEC)  # one seed: the four start identical
    step = AdamParams(learning_rate=1e-2)
    clients.forward_backward(a, sft_data[:1], "cross_entropy")
    clients.forward_backward(b, sft_data[1:], "cross_entropy")
    clients.forward_backward(a, sft_data[:1], "cross_entropy")
    clients.optim_step(b, step)
    clients.optim_step(a, step)
    for model, data in ((alone_a, sft_data[:1]), (alone_a, sft_data[:1]), (alone_b, sft_data[1:])):
        clients.forward_backward(model, data, "cross_entropy")
    clients.optim_step(alone_a, step)
    clients.optim_step(alone_b, step)
    for x, y in ((a, alone_a), (b, alone_b)):
        for p, q in zip(_logprobs(clients, x, sft_data), _logprobs(clients, y, sft_data), strict=True):
            np.testing.assert_allclose(p, q, atol=1e-6)
    assert not np.allclose(_logprobs(clients, a, sft_data)[0], _logprobs(clients, b, sft_data)[0], atol=1e-3)


def test_seed_decides_the_initial_adapter(clients, new_id, sft_data):
    """B starts at zero, so any seed is the base model; the seed shows after one step."""
    first, same, other = new_id(), new_id(), new_id()
    for model, seed in ((first, 11), (same, 11), (other, 12)):
        clients.create(model, LoraSpec(rank=4, seed=seed))
        clients.forward_backward(model, sft_data, "cross_entropy")
        clients.optim_step(model, AdamParams(learning_rate=1e-2))
    logprobs = {m: _logprobs(clients, m, sft_data)[1] for m in (first, same, other)}
    np.testing.assert_array_equal(logprobs[first], logprobs[same])
    assert not np.allclose(logprobs[first], logprobs[other], atol=1e-4)


def test_advantage_sign_sets_the_direction_of_rl_losses(clients, new_id, sft_data):
    datum = sft_data[0]
    n = len(tokens_of(datum))
    sampled = _logprobs(clients, _fresh(clients, new_id), [datum])[0]
    losses = (("importance_sampling", None), ("ppo", None), ("cispo", None), ("dro", {"beta": 0.1}))
    for loss_fn, config in losses:
        moved = []
        for sign in (1.0, -1.0):
            model = _fresh(clients, new_id)
            rl = make_datum(tokens_of(datum), {"target_tokens": inputs_of(datum)["target_tokens"],
                                               "logprobs": sampled,
                                               "advantages": np.full(n, sign, np.float32)})
            clients.forward_backward(model, [rl], loss_fn, config)
            clients.optim_step(model, AdamParams(learning_rate=1e-3))
            moved.append(float((_logprobs(clients, model, [datum])[0] - sampled).sum()))
        assert moved[0] > 0 > moved[1], (loss_fn, moved)


def _fresh(clients, new_id) -> str:
    model = new_id()
    clients.create(model, SPEC)
    return model


def test_thirty_adamw_steps_memorise_three_pairs(clients, new_id, sft_data):
    model = _fresh(clients, new_id)
    losses = []
    for _ in range(30):
        losses.append(clients.forward_backward(model, sft_data, "cross_entropy").metrics["loss:sum"])
        clients.optim_step(model, AdamParams(learning_rate=1e-2))
    final = clients.forward_backward(model, sft_data, "cross_entropy", forward_only=True).metrics["loss:sum"]
    # Measured: 229.6 at the start, 0.013 after 30 steps (22 completion tokens).
    assert losses[0] > 100 and final < 0.1, losses
    assert clients.step_count(model) == 30


def test_micro_batches_give_the_same_result(clients, new_id, sft_data):
    assert micro_batches([5, 9, 2, 9], 18) == [[1, 3], [0, 2]]
    assert micro_batches([50, 3], 8) == [[0], [1]]  # a datum over the budget runs alone
    model = _fresh(clients, new_id)
    together = clients.forward_backward(model, sft_data, "cross_entropy", forward_only=True)
    budget, clients.micro_batch_tokens = clients.micro_batch_tokens, 1
    try:
        alone = clients.forward_backward(model, sft_data, "cross_entropy", forward_only=True)
    finally:
        clients.micro_batch_tokens = budget
    assert alone.metrics["loss:sum"] == pytest.approx(together.metrics["loss:sum"], rel=1e-5)
    for x, y in zip(alone.outputs, together.outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)


def test_refusals_name_the_problem(clients, new_id, sft_data):
    model = _fresh(clients, new_id)
    with pytest.raises(UserError, match="is not loaded"):
        clients.forward_backward(new_id(), sft_data, "cross_entropy")
    with pytest.raises(UserError, match="exists already"):
        clients.create(model, LoraSpec(rank=16))
    clients.create(model, SPEC)  # the same create again (a redelivery) is no error
    with pytest.raises(UserError, match="trains nothing"):
        clients.create(new_id(), LoraSpec(rank=4, train_attn=False, train_mlp=False, train_unembed=False))
    with pytest.raises(UserError, match="out of range"):
        clients.optim_step(model, AdamParams(learning_rate=-1.0))
    clients.drop(model)
    clients.drop(model)  # dropping twice is harmless
    assert model not in clients.models()
