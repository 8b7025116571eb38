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


def test_datums_with_zero_advantages_go_forward_only_and_change_nothing(clients, new_id, sft_data,
                                                                          monkeypatch):
    """An RL batch's groups whose rewards were equal have zero advantages: their gradient is zero,
    so they skip the backward pass. Loss, logprobs and gradient must equal those of the batch with
    every datum through backward (the loss with no ``factor``, which never skips)."""
    import dataclasses

    from loopline.tinker_worker import losses

    sampled = _logprobs(clients, _fresh(clients, new_id), sft_data)
    data = [make_datum(tokens_of(d), {"target_tokens": inputs_of(d)["target_tokens"], "logprobs": lp,
                                      "advantages": np.full(len(lp), a, np.float32)})
            for d, lp, a in zip(sft_data, sampled, (0.0, 1.5, 0.0), strict=True)]
    arrays = losses.check_data(losses.LOSSES["importance_sampling"], data, 10**6, None)
    assert losses.without_gradient(losses.LOSSES["importance_sampling"], arrays) == {0, 2}
    assert losses.without_gradient(losses.LOSSES["dro"], arrays) == set()  # its penalty has a gradient
    passes = clients._passes(data, arrays, losses.LOSSES["importance_sampling"], False)
    assert [(sorted(group), backward) for group, backward in passes] == [([1], True), ([0, 2], False)]

    skipping, every = _fresh(clients, new_id), _fresh(clients, new_id)
    fast = clients.forward_backward(skipping, data, "importance_sampling")
    monkeypatch.setitem(losses.LOSSES, "importance_sampling",
                        dataclasses.replace(losses.LOSSES["importance_sampling"], factor=None))
    full = clients.forward_backward(every, data, "importance_sampling")
    assert fast.metrics["loss:sum"] == pytest.approx(full.metrics["loss:sum"], rel=1e-6)
    for x, y in zip(fast.outputs, full.outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    grads = [[p.grad for p in clients._clients[m].params] for m in (skipping, every)]
    assert any(g is not None and g.abs().sum() > 0 for g in grads[0])
    for x, y in zip(*grads, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_a_step_of_zero_advantages_still_moves_the_adapter_by_momentum(clients, new_id, sft_data,
                                                                       monkeypatch):
    """A batch whose every advantage is zero goes forward only, yet its optim_step must move the
    adapter as AdamW does on a zero gradient (by the momentum of earlier steps), as when every datum
    goes through backward: the recipe's zero-advantage steps, which one process trains too."""
    import dataclasses

    from loopline.tinker_worker import losses

    def rl(lp: np.ndarray, d: Datum, advantage: float) -> Datum:
        return make_datum(tokens_of(d), {"target_tokens": inputs_of(d)["target_tokens"], "logprobs": lp,
                                         "advantages": np.full(len(lp), advantage, np.float32)})

    def two_steps(model: str) -> list[np.ndarray]:
        def step(advantage: float) -> list[np.ndarray]:
            data = [rl(lp, d, advantage) for lp, d in zip(sampled, sft_data, strict=True)]
            clients.forward_backward(model, data, "importance_sampling")
            clients.optim_step(model, AdamParams(learning_rate=1e-2))
            return _logprobs(clients, model, sft_data)

        sampled = _logprobs(clients, model, sft_data)
        after_first, after_second = step(1.0), step(0.0)
        assert any(not np.array_equal(a, b) for a, b in zip(after_first, after_second, strict=True))
        return after_second

    skipping = two_steps(_fresh(clients, new_id))
    monkeypatch.setitem(losses.LOSSES, "importance_sampling",
                        dataclasses.replace(losses.LOSSES["importance_sampling"], factor=None))
    every = two_steps(_fresh(clients, new_id))
    for x, y in zip(skipping, every, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_several_clients_in_one_pass_get_what_each_would_alone(clients, new_id, sft_data):
    """Calls of different clients share passes (each row through its own adapter): every call's
    loss, logprobs and gradient equal that call run alone, and a call the caller got wrong fails
    alone."""
    from loopline.tinker_worker.training import PassCall

    def trained_pair() -> tuple[str, str]:
        first, second = _fresh(clients, new_id), new_id()
        clients.create(second, LoraSpec(rank=4, seed=9))
        for model in (first, second):  # non-zero B, so each adapter changes its rows' logits
            clients.forward_backward(model, sft_data, "cross_entropy")
            clients.optim_step(model, AdamParams(learning_rate=1e-2))
        return first, second

    calls = lambda a, b: [PassCall(a, sft_data, "cross_entropy"),  # noqa: E731
                          PassCall(b, sft_data[:2], "cross_entropy"),
                          PassCall(a, sft_data, "no_such_loss"),
                          PassCall(b, sft_data[1:], "cross_entropy", forward_only=True)]
    pooled_models, alone_models = trained_pair(), trained_pair()
    pooled = clients.forward_backward_many(calls(*pooled_models))
    alone = [clients.forward_backward_many([call])[0] for call in calls(*alone_models)]
    assert isinstance(pooled[2], UserError) and "no_such_loss" in str(pooled[2])
    for k in (0, 1, 3):
        assert pooled[k].metrics["loss:sum"] == pytest.approx(alone[k].metrics["loss:sum"], rel=1e-5)
        for x, y in zip(pooled[k].outputs, alone[k].outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    for mine, theirs in zip(pooled_models, alone_models, strict=True):
        for x, y in zip(clients._clients[mine].params, clients._clients[theirs].params, strict=True):
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)
