"""Tinker's built-in losses, token by token, and the checks on what a call sends them.

Definitions follow Tinker's loss documentation (tinker-docs.thinkingmachines.ai/tinker/losses):
every loss is a SUM over tokens and data, never a mean (the SDK's ``forward_backward_custom``
relies on it), and ``metrics["loss:sum"]`` is that sum. With ``lp`` the learner's log-probability of
the target token (computed here), ``s`` the sampler's (input ``logprobs``) and ``A`` the advantages:

    cross_entropy         -lp * weights                       (weights optional: ones)
    importance_sampling   -exp(lp - s) * A
    ppo                   -min(r * A, clip(r, low, high) * A)           r = exp(lp - s)
    cispo                 -sg(clip(r, low, high)) * lp * A              sg: no gradient through it
    dro                   -(lp * A - beta / 2 * (lp - s)^2)
    gspo, stable_reinforce                                    in sequence_losses.py

Cross-entropy also takes soft targets: ``target_tokens`` and ``weights`` of shape (N, K), K
candidate tokens per position (a teacher's top K, say), and then sums ``-lp[n, k] * weights[n, k]``
over both axes (docs/tinker.md, "Cross-entropy on soft targets", gives the sources). Its output
``logprobs`` has the shape of ``target_tokens``.

``low``/``high`` are thresholds on the ratio itself (documented defaults 0.8 / 1.2); a datum may
also carry them per token as inputs (the SDK types those keys). DRO's ``beta`` has no documented
default, so it is required. The RL losses take no ``weights``: Tinker refuses inputs a loss does
not know (DRO answers "unexpected keyword argument 'weights'", tinker-cookbook#907; the cookbook
strips its ``mask`` before sending), and so do we, naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinker import types as tt
from torch import Tensor

from . import sequence_losses
from .types import UserError

TARGETS = "target_tokens"
PerToken = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]
Prepare = Callable[[int, tt.Datum, dict[str, np.ndarray]], None]


def _ratio(lp: Tensor, x: dict[str, Tensor]) -> Tensor:
    return torch.exp(lp - x["logprobs"])


def _clipped(ratio: Tensor, x: dict[str, Tensor]) -> Tensor:
    return torch.minimum(torch.maximum(ratio, x["clip_low_threshold"]), x["clip_high_threshold"])


def cross_entropy(lp: Tensor, x: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -lp * x["weights"]


def importance_sampling(lp: Tensor, x: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -_ratio(lp, x) * x["advantages"]


def ppo(lp: Tensor, x: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    ratio = _ratio(lp, x)
    return -torch.minimum(ratio * x["advantages"], _clipped(ratio, x) * x["advantages"])


def cispo(lp: Tensor, x: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -_clipped(_ratio(lp, x), x).detach() * lp * x["advantages"]


def dro(lp: Tensor, x: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -(lp * x["advantages"] - 0.5 * cfg["beta"] * (lp - x["logprobs"]) ** 2)


@dataclass(frozen=True)
class Loss:
    name: str
    per_token: PerToken
    required: tuple[str, ...]  # inputs every datum must carry (target_tokens among them)
    # optional inputs -> the config key whose value fills a datum that lacks it (None: 1.0)
    optional: Mapping[str, str | None]
    config: Mapping[str, float | None]  # loss_fn_config keys and defaults; None: required
    soft_targets: bool = False  # takes (N, K) target_tokens (and inputs of that shape) as well as (N,)
    # Adds arrays to a datum's checked inputs (from its provenance, or defaults that depend on other
    # inputs), raising UserError; ``derived`` names those that are not inputs a client may send.
    prepare: Prepare | None = None
    derived: tuple[str, ...] = ()
    # The input every token's loss is multiplied by: a datum where it is all zero has a loss of
    # exactly zero gradient, so it needs a forward pass (its logprobs, its loss) but no backward.
    # None where no input does that (DRO's penalty term, cross-entropy without weights).
    factor: str | None = None


ADVANTAGES = "advantages"
_RL = (TARGETS, "logprobs", ADVANTAGES)
_CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("cross_entropy", cross_entropy, (TARGETS,), {"weights": None}, {}, soft_targets=True,
         factor="weights"),
    Loss("importance_sampling", importance_sampling, _RL, {}, {}, factor=ADVANTAGES),
    Loss("ppo", ppo, _RL, {k: k for k in _CLIPS}, _CLIPS, factor=ADVANTAGES),
    Loss("cispo", cispo, _RL, {k: k for k in _CLIPS}, _CLIPS, factor=ADVANTAGES),
    Loss("dro", dro, _RL, {}, {"beta": None}),
    # A sequence loss's ratio is its own datum's: another datum's advantages never reach it.
    Loss("gspo", sequence_losses.gspo, _RL, {sequence_losses.RATIO_MASK: None,
                                             **{k: k for k in sequence_losses.GSPO_CLIPS}},
         sequence_losses.GSPO_CLIPS, prepare=sequence_losses.default_ratio_mask, factor=ADVANTAGES),
    Loss("stable_reinforce", sequence_losses.stable_reinforce, _RL, {}, {},
         prepare=sequence_losses.sampled_positions, derived=(sequence_losses.SAMPLED,),
         factor=ADVANTAGES),
)}
_NOT_HERE = ("custom",)


def resolve(loss_fn: str, loss_fn_config: Mapping[str, Any] | None) -> tuple[Loss, dict[str, float]]:
    """The loss and its full config (defaults filled in); UserError names what is wrong."""
    loss = LOSSES.get(loss_fn)
    if loss is None:
        hint = " (not implemented on this server)" if loss_fn in _NOT_HERE else ""
        raise UserError(f"unknown loss_fn {loss_fn!r}{hint}; this server has {', '.join(LOSSES)}")
    given = dict(loss_fn_config or {})
    unknown = sorted(set(given) - set(loss.config))
    if unknown:
        allowed = ", ".join(loss.config) or "none"
        raise UserError(f"loss_fn_config for {loss_fn} has unknown key(s) {unknown}; it takes {allowed}")
    config: dict[str, float] = {}
    for key, default in loss.config.items():
        value = given.get(key, default)
        if value is None:
            raise UserError(f"{loss_fn} needs loss_fn_config[{key!r}]")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise UserError(f"loss_fn_config[{key!r}] must be a finite number, not {value!r}")
        config[key] = float(value)
    low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 0.0)
    if "clip_low_threshold" in config and not 0 <= low <= high:
        raise UserError(f"loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} "
                        f"and {high}")
    if config.get("beta", 0.0) < 0:
        raise UserError(f"loss_fn_config['beta'] must be >= 0, got {config['beta']}")
    return loss, config


def check_data(loss: Loss, data: list[tt.Datum], vocab_size: int,
               max_tokens: int | None) -> list[dict[str, np.ndarray]]:
    """Each datum's inputs as arrays of the right dtype and length; UserError on the first fault."""
    if not data:
        raise UserError("forward_backward needs at least one datum")
    checked = []
    for i, datum in enumerate(data):
        n = datum.model_input.length
        if n == 0:
            raise UserError(f"datum {i}: model_input has no tokens")
        if max_tokens is not None and n > max_tokens:
            raise UserError(f"datum {i}: {n} tokens, more than the model's {max_tokens}")
        tokens = np.asarray(datum.model_input.to_ints())
        if tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() >= vocab_size:
            raise UserError(f"datum {i}: model_input tokens must be ids in [0, {vocab_size})")
        unknown = sorted(set(datum.loss_fn_inputs) - set(loss.required) - set(loss.optional))
        if unknown:
            raise UserError(f"datum {i}: {loss.name} takes no input(s) {unknown}; it takes "
                            f"{', '.join([*loss.required, *loss.optional])}")
        missing = [k for k in loss.required if k not in datum.loss_fn_inputs]
        if missing:
            raise UserError(f"datum {i}: {loss.name} needs loss_fn_inputs {missing}")
        arrays = {}
        # Every input has the shape of target_tokens: (n,), or (n, K) where the loss takes soft targets.
        shape = _targets_shape(loss, i, datum.loss_fn_inputs[TARGETS].to_numpy().shape, n)
        for key, value in datum.loss_fn_inputs.items():
            array = value.to_numpy()
            if array.shape != shape:
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has shape {array.shape}, the "
                                f"model input has {n} tokens: it must be {shape}")
            if key == TARGETS:
                if array.dtype.kind not in "iu" or array.min() < 0 or array.max() >= vocab_size:
                    raise UserError(f"datum {i}: target_tokens must be token ids in [0, {vocab_size})")
                arrays[key] = array.astype(np.int64)
            else:
                if array.dtype.kind not in "iuf" or not np.isfinite(array).all():
                    raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] must hold finite numbers")
                arrays[key] = array.astype(np.float32)
        if loss.prepare is not None:
            loss.prepare(i, datum, arrays)
        checked.append(arrays)
    return checked


def _targets_shape(loss: Loss, i: int, shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The shape every input of datum ``i`` must have, from its target_tokens' shape."""
    if loss.soft_targets and len(shape) == 2 and shape[0] == n and shape[1] >= 1:
        return shape
    if shape == (n,):
        return shape
    wanted = f"({n},) or ({n}, K) with K >= 1" if loss.soft_targets else f"({n},)"
    raise UserError(f"datum {i}: loss_fn_inputs[{TARGETS!r}] has shape {shape}, the model input has {n} "
                    f"tokens: it must be {wanted}")


def without_gradient(loss: Loss, arrays: list[dict[str, np.ndarray]]) -> set[int]:
    """The datums whose part of the loss has a zero gradient whatever the weights: ``loss.factor``
    is all zero on them (the groups of an RL batch whose rewards were all equal, typically half or
    more of them). A datum without the input (an optional weight of 1) is not among them."""
    if loss.factor is None:
        return set()
    return {i for i, a in enumerate(arrays) if loss.factor in a and not a[loss.factor].any()}


def fill_value(loss: Loss, config: dict[str, float], key: str) -> float:
    """What an optional input is when a datum does not carry it."""
    source = loss.optional[key]
    return 1.0 if source is None else config[source]
