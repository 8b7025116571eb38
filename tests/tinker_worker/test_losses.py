"""Tinker's losses on hand-made numbers (values and gradient signs), and what a call may send them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker.types import AdamParams, Datum

from loopline.common.contracts.tinker_schemas import LoraSpec
from loopline.tinker_worker.losses import LOSSES, check_data, resolve
from loopline.tinker_worker.types import UserError
from support.tinker_data import make_datum


def _run(name: str, lp: list[float], s: list[float], adv: list[float], config: dict | None = None):
    """Loss value and d loss / d lp for per-token learner logprobs ``lp``."""
    loss, cfg = resolve(name, config)
    lp_t = torch.tensor(lp, requires_grad=True)
    x = {"logprobs": torch.tensor(s), "advantages": torch.tensor(adv),
         "clip_low_threshold": torch.full((len(lp),), cfg.get("clip_low_threshold", 0.0)),
         "clip_high_threshold": torch.full((len(lp),), cfg.get("clip_high_threshold", 0.0))}
    total = loss.per_token(lp_t, x, cfg).sum()
    total.backward()
    assert lp_t.grad is not None
    return total.item(), lp_t.grad.tolist()


def test_cross_entropy_is_a_weighted_sum_of_negative_logprobs():
    loss, cfg = resolve("cross_entropy", None)
    lp = torch.tensor([-1.0, -2.0, -3.0])
    assert loss.per_token(lp, {"weights": torch.tensor([0.0, 1.0, 0.5])}, cfg).sum().item() == 3.5


def test_importance_sampling_value_and_direction():
    value, grad = _run("importance_sampling", [-1.0, -2.0], [-1.5, -2.0], [2.0, -1.0])
    assert value == pytest.approx(-(math.exp(0.5) * 2.0) + 1.0)
    # Descent raises the logprob of a token with positive advantage and lowers a negative one's.
    assert grad == pytest.approx([-2.0 * math.exp(0.5), 1.0])


def test_ppo_clips_the_ratio_where_it_would_push_further():
    low, high = 0.8, 1.2
    lp = [math.log(1.5), math.log(1.0), math.log(0.5), math.log(0.5)]
    adv = [1.0, 1.0, 1.0, -1.0]
    value, grad = _run("ppo", lp, [0.0] * 4, adv)
    # ratio 1.5, A > 0: clipped to 1.2, no gradient; ratio 1: plain IS; ratio 0.5, A > 0: the
    # unclipped term is smaller, kept (gradient flows); ratio 0.5, A < 0: clipped to 0.8, no gradient.
    assert value == pytest.approx(-(high * 1 + 1.0 + 0.5 - low))
    assert grad == pytest.approx([0.0, -1.0, -0.5, 0.0])
    value, _ = _run("ppo", lp, [0.0] * 4, adv, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert value == pytest.approx(-(1.1 + 1.0 + 0.5 - 0.9))


def test_cispo_weights_logp_by_a_clipped_ratio_without_its_gradient():
    lp = [math.log(2.0), math.log(0.9)]
    value, grad = _run("cispo", lp, [0.0, 0.0], [1.0, -2.0])
    assert value == pytest.approx(-(1.2 * lp[0] * 1.0 + 0.9 * lp[1] * -2.0))
    assert grad == pytest.approx([-1.2, 1.8])  # the clipped ratio times the advantage, no more


def test_dro_adds_a_quadratic_penalty_towards_the_sampler():
    value, grad = _run("dro", [-1.0, -1.0], [-2.0, -1.0], [0.0, 1.0], {"beta": 0.5})
    assert value == pytest.approx(0.5 * 0.5 * 1.0 + 1.0)
    # The first token has no advantage: only the penalty pulls it back down towards the sampler.
    assert grad == pytest.approx([0.5, -1.0])


@pytest.mark.parametrize(("loss_fn", "config", "message"), [
    ("mse", None, "unknown loss_fn 'mse'"),
    ("custom", None, "not implemented"),
    ("ppo", {"clip": 0.2}, "unknown key(s) ['clip']"),
    ("cross_entropy", {"beta": 1.0}, "it takes none"),
    ("dro", None, "dro needs loss_fn_config['beta']"),
    ("ppo", {"clip_low_threshold": 1.5}, "clip_low_threshold <= clip_high_threshold"),
    ("cispo", {"clip_high_threshold": "big"}, "must be a finite number"),
    ("dro", {"beta": -1.0}, "beta"),
])
def test_bad_loss_or_config_is_a_user_error(loss_fn, config, message):
    with pytest.raises(UserError) as caught:
        resolve(loss_fn, config)
    assert message in str(caught.value)


def _datum(n: int = 3, **inputs) -> Datum:
    return make_datum(list(range(1, n + 1)), {k: np.asarray(v) for k, v in inputs.items()})


@pytest.mark.parametrize(("loss_fn", "datum", "message"), [
    ("cross_entropy", _datum(weights=[1.0, 1.0, 1.0]), "needs loss_fn_inputs ['target_tokens']"),
    ("importance_sampling", _datum(target_tokens=[1, 2, 3], advantages=[1.0] * 3), "['logprobs']"),
    ("importance_sampling", _datum(target_tokens=[1, 2, 3], logprobs=[0.0] * 3, advantages=[0.0] * 3,
                                   mask=[1.0] * 3), "takes no input(s) ['mask']"),
    ("dro", _datum(target_tokens=[1, 2, 3], logprobs=[0.0] * 3, advantages=[0.0] * 3,
                   weights=[1.0] * 3), "takes no input(s) ['weights']"),
    ("cross_entropy", _datum(target_tokens=[1, 2]), "has shape (2,)"),
    ("cross_entropy", _datum(target_tokens=[1, 2, 5000]), "[0, 1024)"),
    ("cross_entropy", _datum(target_tokens=[1, 2, 3], weights=[1.0, float("nan"), 1.0]), "finite"),
    ("cross_entropy", make_datum([], {}), "no tokens"),
])
def test_bad_inputs_are_user_errors_naming_the_input(loss_fn, datum, message):
    with pytest.raises(UserError) as caught:
        check_data(LOSSES[loss_fn], [datum], vocab_size=1024, max_tokens=None)
    assert message in str(caught.value)
    assert "datum 0" in str(caught.value)


def test_inputs_come_back_typed():
    [arrays] = check_data(LOSSES["cross_entropy"], [_datum(target_tokens=[1, 2, 3], weights=[0, 1, 1])],
                          vocab_size=1024, max_tokens=8)
    assert arrays["target_tokens"].dtype == np.int64 and arrays["weights"].dtype == np.float32
    with pytest.raises(UserError, match="at least one datum"):
        check_data(LOSSES["cross_entropy"], [], vocab_size=1024, max_tokens=8)
    with pytest.raises(UserError, match="more than the model's 2"):
        check_data(LOSSES["cross_entropy"], [_datum(target_tokens=[1, 2, 3])], vocab_size=1024, max_tokens=2)


# --- cross-entropy on (N, K) soft targets ------------------------------------------------------------

def _soft(datum: Datum, k: int, seed: int) -> Datum:
    """The datum's positions with K candidate tokens each and teacher-like weights: a distribution
    over the K (renormalised top-K, as the cookbook's sdft builds them) on weighted positions, 0 on
    the others."""
    rng = np.random.default_rng(seed)
    inputs = {key: v.to_numpy() for key, v in datum.loss_fn_inputs.items()}
    n = datum.model_input.length
    targets = rng.integers(0, 1024, size=(n, k))
    targets[:, 0] = inputs["target_tokens"]
    probs = rng.dirichlet(np.ones(k), size=n).astype(np.float32)
    weights = probs * (inputs["weights"] > 0)[:, None]
    return make_datum(datum.model_input.to_ints(), {"target_tokens": targets, "weights": weights})


def _soft_reference(tiny_path: str, datum: Datum) -> tuple[float, np.ndarray]:
    """H(q, p) = -sum_n sum_v q_n(v) log p_n(v) from a separately loaded HF model, with q_n the dense
    distribution that puts weights[n, k] on target_tokens[n, k] (torch's probability-target
    cross-entropy, another code path than the worker's gather), and the (N, K) logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    inputs = {key: torch.from_numpy(v.to_numpy()) for key, v in datum.loss_fn_inputs.items()}
    with torch.no_grad():
        logits = model(torch.tensor([datum.model_input.to_ints()])).logits[0]
    dense = torch.zeros_like(logits).index_put_((torch.arange(logits.shape[0])[:, None].expand_as(
        inputs["target_tokens"]), inputs["target_tokens"]), inputs["weights"].float(), accumulate=True)
    loss = torch.nn.functional.cross_entropy(logits, dense, reduction="sum")
    logprobs = torch.log_softmax(logits.double(), -1).gather(1, inputs["target_tokens"]).float()
    return float(loss), logprobs.numpy()


def test_soft_target_cross_entropy_matches_an_independent_computation(clients, new_id, sft_data, tiny_path):
    model = new_id()
    clients.create(model, LoraSpec(rank=8, seed=3))  # B = 0: the learner is the base model
    soft = [_soft(d, k, seed) for seed, (d, k) in enumerate(zip(sft_data, [20, 5, 1], strict=True))]
    result = clients.forward_backward(model, soft, "cross_entropy", forward_only=True)
    expected = 0.0
    for datum, output in zip(soft, result.outputs, strict=True):
        value, logprobs = _soft_reference(tiny_path, datum)
        assert output["logprobs"].shape == datum.loss_fn_inputs["target_tokens"].to_numpy().shape
        np.testing.assert_allclose(output["logprobs"], logprobs, atol=1e-4)
        expected += value
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_soft_targets_with_one_candidate_are_hard_targets(clients, new_id, sft_data):
    """(N, 1) targets, and (N, 2) ones that split a weight over the same token twice, give the (N,)
    cross-entropy's loss, logprobs and gradient; (N,) and (N, K) datums mix in one call."""
    def run(data):
        model = new_id()
        clients.create(model, LoraSpec(rank=8, seed=3, train_unembed=True))
        clients.optim_step(model, AdamParams(learning_rate=1e-2))  # no gradient yet: B stays 0
        # One step with a nonzero gradient moves B off 0, so the next gradient reaches every param.
        clients.forward_backward(model, sft_data, "cross_entropy")
        clients.optim_step(model, AdamParams(learning_rate=1e-2))
        result = clients.forward_backward(model, data, "cross_entropy")
        grads = [p.grad.clone() for p in clients._client(model).params]
        clients.drop(model)
        return result, grads

    def reshaped(datum, columns):
        x = {key: v.to_numpy() for key, v in datum.loss_fn_inputs.items()}
        return make_datum(datum.model_input.to_ints(), {
            "target_tokens": np.repeat(x["target_tokens"][:, None], columns, 1),
            "weights": np.repeat(x["weights"][:, None] / columns, columns, 1)})

    hard, hard_grads = run(sft_data)
    mixed = [reshaped(sft_data[0], 1), reshaped(sft_data[1], 2), sft_data[2]]
    soft, soft_grads = run(mixed)
    assert soft.metrics["loss:sum"] == pytest.approx(hard.metrics["loss:sum"], rel=1e-5)
    np.testing.assert_allclose(soft.outputs[0]["logprobs"][:, 0], hard.outputs[0]["logprobs"], atol=1e-5)
    np.testing.assert_allclose(soft.outputs[1]["logprobs"], np.repeat(hard.outputs[1]["logprobs"][:, None],
                                                                     2, 1), atol=1e-5)
    assert soft.outputs[2]["logprobs"].shape == hard.outputs[2]["logprobs"].shape
    assert any(g.abs().sum() > 0 for g in hard_grads)
    for a, b in zip(soft_grads, hard_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("loss_fn", "inputs", "message"), [
    ("cross_entropy", {"target_tokens": np.ones((3, 2), np.int64), "weights": np.ones(3, np.float32)},
     "loss_fn_inputs['weights'] has shape (3,), the model input has 3 tokens: it must be (3, 2)"),
    ("cross_entropy", {"target_tokens": np.ones((3, 0), np.int64)}, "it must be (3,) or (3, K) with K >= 1"),
    ("cross_entropy", {"target_tokens": np.ones((3, 2, 2), np.int64)}, "or (3, K)"),
    ("cross_entropy", {"target_tokens": np.full((3, 2), 1024, np.int64)}, "[0, 1024)"),
    ("importance_sampling", {"target_tokens": np.ones((3, 2), np.int64), "logprobs": np.zeros((3, 2)),
                             "advantages": np.zeros((3, 2))}, "it must be (3,)"),
])
def test_bad_soft_targets_are_user_errors(loss_fn, inputs, message):
    with pytest.raises(UserError) as caught:
        check_data(LOSSES[loss_fn], [_datum(**inputs)], vocab_size=1024, max_tokens=None)
    assert message in str(caught.value)
