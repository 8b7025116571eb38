"""GSPO and StableReinforce through the worker's own path (checked inputs, padded micro-batch, the
per-token loss), against an independent computation of each datum alone in plain Python: values and
gradients, and the 400s for what a call sends them wrong."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from tinker import types as tt

from loopline.tinker_worker.batching import build
from loopline.tinker_worker.losses import LOSSES, check_data, resolve
from loopline.tinker_worker.types import UserError
from support.tinker_data import make_datum


def _through_the_worker(name: str, data: list[tt.Datum], lps: list[list[float]],
                        config: dict | None = None) -> tuple[float, list[list[float]]]:
    """The summed loss and d loss / d lp per datum, for learner logprobs ``lps``, batched as the worker
    batches them (right-padded rows of different lengths)."""
    loss, cfg = resolve(name, config)
    arrays = check_data(loss, data, vocab_size=1024, max_tokens=None)
    batch = build(list(range(len(data))), data, arrays, loss, cfg, torch.device("cpu"))
    width = batch.targets.shape[1]
    padded = [row + [-0.5] * (width - len(row)) for row in lps]  # pads hold some logprob, as in a pass
    lp = torch.tensor(padded, requires_grad=True)
    total = torch.where(batch.real, loss.per_token(lp, batch.inputs, cfg), 0.0).sum()
    total.backward()
    assert lp.grad is not None
    return total.item(), [lp.grad[r, :len(row)].tolist() for r, row in enumerate(lps)]


def _gspo_alone(lp, s, adv, mask, low, high):
    """GSPO-token for one datum by the paper's definition (Zheng et al. 2025, eq. for GSPO-token):
    the loss and its gradient in each token's logprob."""
    picked = [t for t, m in enumerate(mask) if m]
    ratio = math.exp(sum(lp[t] - s[t] for t in picked) / len(picked)) if picked else 1.0
    value, grad = 0.0, []
    for a in adv:
        unclipped, clipped = ratio * a, min(max(ratio, low), high) * a
        value -= min(unclipped, clipped)
        # d(ratio_t)/d(lp_t) = ratio; the clipped branch is constant in lp.
        grad.append(-ratio * a if unclipped <= clipped else 0.0)
    return value, grad


def test_gspo_matches_the_per_sequence_definition_across_a_padded_batch():
    q = [[-1.0, -0.7, -2.0, -0.3], [-1.2, -0.4]]
    lp = [[-0.9, -0.6, -2.3, -0.2], [-1.0, -0.1]]
    adv = [[0.0, 1.5, 1.5, 1.5], [-2.0, -2.0]]
    mask = [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0]]
    data = [make_datum(list(range(1, len(row) + 1)), {
        "target_tokens": np.arange(2, len(row) + 2), "logprobs": np.asarray(q[i], dtype=np.float32),
        "advantages": np.asarray(adv[i], dtype=np.float32),
        "sequence_ratio_mask": np.asarray(mask[i], dtype=np.float32)}) for i, row in enumerate(lp)]
    for config, (low, high) in [(None, (1 - 3e-4, 1 + 4e-4)),
                                ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, (0.8, 1.2))]:
        value, grads = _through_the_worker("gspo", data, lp, config)
        expected = [_gspo_alone(lp[i], q[i], adv[i], mask[i], low, high) for i in range(2)]
        assert value == pytest.approx(sum(v for v, _ in expected), rel=1e-5)
        for got, (_, want) in zip(grads, expected, strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # With wide thresholds nothing is clipped: every token of a datum has the same gradient weight.
    _, grads = _through_the_worker("gspo", data, lp, {"clip_low_threshold": 0.0, "clip_high_threshold": 9.0})
    ratio = math.exp(((-0.6 + 0.7) + (-2.3 + 2.0) + (-0.2 + 0.3)) / 3)
    assert grads[0] == pytest.approx([0.0, -1.5 * ratio, -1.5 * ratio, -1.5 * ratio], rel=1e-5)


def test_gspo_without_a_mask_takes_the_ratio_over_the_tokens_with_an_advantage():
    # The cookbook's rl/train.py shape: prompt positions have advantage 0 and a placeholder logprob 0.
    q, lp, adv = [0.0, 0.0, -1.0, -1.0], [-5.0, -6.0, -0.9, -1.1], [0.0, 0.0, 1.0, 1.0]
    datum = make_datum([1, 2, 3, 4], {"target_tokens": np.asarray([2, 3, 4, 5]),
                                      "logprobs": np.asarray(q, dtype=np.float32),
                                      "advantages": np.asarray(adv, dtype=np.float32)})
    config = {"clip_low_threshold": 0.0, "clip_high_threshold": 9.0}
    value, [grad] = _through_the_worker("gspo", [datum], [lp], config)
    want_value, want_grad = _gspo_alone(lp, q, adv, [0, 0, 1, 1], 0.0, 9.0)
    assert value == pytest.approx(want_value, rel=1e-5)  # ratio exp(0) = 1: the prompt is not in it
    assert grad == pytest.approx(want_grad, rel=1e-5)


def _provenanced(tokens: int, prompt: int, inputs: dict) -> tt.Datum:
    """A datum as the cookbook builds one: the first ``prompt`` targets from the prompt, the rest sampled."""
    datum = make_datum(list(range(1, tokens + 1)), {k: np.asarray(v) for k, v in inputs.items()})
    return datum.with_provenance(
        model_input=[tt.PromptProvenanceSpan(sequence_id="r:0", length=prompt + 1),
                     tt.SampledProvenanceSpan(sequence_id="r:0", length=tokens - prompt - 1)],
        loss_fn_inputs=[tt.PromptProvenanceSpan(sequence_id="r:0", offset=1, length=prompt),
                        tt.SampledProvenanceSpan(sequence_id="r:0", length=tokens - prompt)])


def test_stable_reinforce_trains_sampled_tokens_with_a_capped_weight_without_gradient():
    q = [0.0, -1.0, -2.0, -0.5, -3.0]
    lp = [-4.0, -1.1, -0.5, -0.5, -3.2]  # ratios: (prompt), 0.90, 4.48 (capped at 2), 1, 0.82
    adv = [0.7, 1.0, 1.0, -2.0, 0.5]  # the prompt's advantage is not trained
    datum = _provenanced(5, 1, {"target_tokens": [2, 3, 4, 5, 6], "logprobs": np.asarray(q, np.float32),
                                "advantages": np.asarray(adv, np.float32)})
    other = _provenanced(2, 0, {"target_tokens": [7, 8], "logprobs": np.asarray([-1.0, -1.0], np.float32),
                                "advantages": np.asarray([1.0, 1.0], np.float32)})
    value, grads = _through_the_worker("stable_reinforce", [datum, other], [lp, [-1.0, -1.0]])
    weights = [0.0] + [min(math.exp(a - b), 2.0) for a, b in zip(lp[1:], q[1:], strict=True)]
    want = -sum(w * a * x for w, a, x in zip(weights, adv, lp, strict=True)) - (-1.0 - 1.0)
    assert value == pytest.approx(want, rel=1e-5)
    assert grads[0] == pytest.approx([-w * a for w, a in zip(weights, adv, strict=True)], rel=1e-5)
    assert grads[1] == pytest.approx([-1.0, -1.0])  # on-policy: plain REINFORCE, A times grad lp


def test_stable_reinforce_on_policy_has_the_gradient_of_importance_sampling():
    q = [-0.3, -1.7, -0.9]
    inputs = {"target_tokens": [2, 3, 4], "logprobs": np.asarray(q, np.float32),
              "advantages": np.asarray([1.0, -0.5, 2.0], np.float32)}
    _, stable = _through_the_worker("stable_reinforce", [_provenanced(3, 0, inputs)], [q])
    _, plain = _through_the_worker("importance_sampling", [make_datum([1, 2, 3], {
        k: np.asarray(v) for k, v in inputs.items()})], [q])
    assert stable[0] == pytest.approx(plain[0], rel=1e-6)


def _spans_as_sent(model: int, targets: int) -> tt.Datum:
    """A 3-token datum whose spans cover ``model`` and ``targets`` positions: what a client that skips
    the SDK's own check (``with_provenance``) can put on the wire."""
    return dataclasses.replace(make_datum([1, 2, 3], _rl_inputs()),
                               model_input_spans=[tt.SampledProvenanceSpan(sequence_id="r:0", length=model)],
                               loss_fn_input_spans=[tt.SampledProvenanceSpan(sequence_id="r:0",
                                                                             length=targets)])


def _rl_inputs(n: int = 3) -> dict:
    return {"target_tokens": np.arange(2, n + 2), "logprobs": np.zeros(n, np.float32),
            "advantages": np.ones(n, np.float32)}


@pytest.mark.parametrize(("loss_fn", "datum", "message"), [
    ("stable_reinforce", make_datum([1, 2, 3], _rl_inputs()), "needs provenance on every datum"),
    ("stable_reinforce", _spans_as_sent(3, 2), "loss_fn_input_spans cover 2 positions, the datum has 3"),
    ("stable_reinforce", _spans_as_sent(4, 3), "model_input_spans cover 4 positions"),
    ("stable_reinforce", make_datum([1, 2, 3], {**_rl_inputs(), "sampled": np.ones(3, np.float32)}),
     "takes no input(s) ['sampled']"),
    ("gspo", make_datum([1, 2, 3], {**_rl_inputs(), "sequence_ratio_mask": np.ones(2, np.float32)}),
     "loss_fn_inputs['sequence_ratio_mask'] has shape (2,)"),
    ("gspo", make_datum([1, 2, 3], {**_rl_inputs(), "sequence_ratio_mask": np.asarray([1, np.inf, 0],
                                                                                      np.float32)}),
     "must hold finite numbers"),
    ("gspo", make_datum([1, 2, 3], {k: v for k, v in _rl_inputs().items() if k != "logprobs"}),
     "gspo needs loss_fn_inputs ['logprobs']"),
    ("gspo", make_datum([1, 2, 3], {**_rl_inputs(), "weights": np.ones(3, np.float32)}),
     "takes no input(s) ['weights']"),
])
def test_bad_inputs_are_user_errors_naming_the_datum(loss_fn, datum, message):
    with pytest.raises(UserError) as caught:
        check_data(LOSSES[loss_fn], [datum], vocab_size=1024, max_tokens=None)
    assert message in str(caught.value) and "datum 0" in str(caught.value)


@pytest.mark.parametrize(("loss_fn", "config", "message"), [
    ("stable_reinforce", {"beta": 1.0}, "it takes none"),
    ("gspo", {"clip_low_threshold": 1.1, "clip_high_threshold": 1.0}, "clip_low_threshold <= clip_high"),
    ("gspo", {"epsilon": 0.2}, "unknown key(s) ['epsilon']"),
])
def test_bad_configs_are_user_errors(loss_fn, config, message):
    with pytest.raises(UserError, match="") as caught:
        resolve(loss_fn, config)
    assert message in str(caught.value)
