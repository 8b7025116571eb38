"""The two RL losses that look past one token: GSPO (a ratio per sequence) and StableReinforce
(trains only the tokens a datum's provenance names as sampled). docs/tinker.md, "GSPO and
StableReinforce", gives the formulas and their sources.

With ``lp`` the learner's log-probability of each target token, ``s`` the sampler's (input
``logprobs``), ``A`` the advantages and ``sg`` a stop-gradient, summed over tokens like every Tinker
loss:

    gspo              -min(r_t * A, clip(r_t, low, high) * A)
                      r_t = exp(mean_{u in M}(sg(lp_u) - s_u) + lp_t - sg(lp_t))   (one M per datum)
    stable_reinforce  -sampled * sg(min(exp(lp - s), CAP)) * A * lp

GSPO's ``M`` is the datum's ``sequence_ratio_mask`` (nonzero: in the ratio); a datum without one
takes the positions with a nonzero advantage (the cookbook's ``rl/train.py`` sends no mask, and its
prompt positions carry advantage 0 and a placeholder logprob 0 that would swamp the mean). A datum
with an empty ``M`` has ratio 1. ``sampled`` is 1 where the datum's ``loss_fn_input_spans`` name a
sampled token, 0 where they name a prompt token.

A loss's ``prepare`` turns a datum's provenance and defaults into arrays beside its inputs, checked,
before any compute: a fault is the caller's, a ``UserError`` naming the datum.
"""

from __future__ import annotations

import numpy as np
import torch
from tinker import types as tt
from torch import Tensor

from .types import UserError

SAMPLED = "sampled"  # derived from provenance: 1 where the target is a sampled token
RATIO_MASK = "sequence_ratio_mask"
# StableReinforce's cap on the importance weight (truncated importance sampling's C = 2, Yao et al.
# 2025); the weight carries no gradient, so the update stays REINFORCE's direction.
CAP = 2.0
# GSPO's clipping range of the sequence ratio (Zheng et al. 2025, section 5.1: 3e-4 below, 4e-4 above).
GSPO_CLIPS = {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}


def gspo(lp: Tensor, x: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    mask = (x[RATIO_MASK] != 0).to(lp.dtype)  # padding is 0: never in a ratio
    count = mask.sum(dim=-1, keepdim=True)
    log_ratio = ((lp.detach() - x["logprobs"]) * mask).sum(dim=-1, keepdim=True) / count.clamp(min=1.0)
    ratio = torch.exp(log_ratio + lp - lp.detach())  # the sequence's value, the token's own gradient
    clipped = torch.minimum(torch.maximum(ratio, x["clip_low_threshold"]), x["clip_high_threshold"])
    return -torch.minimum(ratio * x["advantages"], clipped * x["advantages"])


def stable_reinforce(lp: Tensor, x: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    weight = torch.exp(lp - x["logprobs"]).clamp(max=CAP).detach()
    return -x[SAMPLED] * weight * x["advantages"] * lp


def default_ratio_mask(i: int, datum: tt.Datum, arrays: dict[str, np.ndarray]) -> None:
    """GSPO without a ``sequence_ratio_mask``: the positions that carry an advantage."""
    if RATIO_MASK not in arrays:
        arrays[RATIO_MASK] = (arrays["advantages"] != 0).astype(np.float32)


def sampled_positions(i: int, datum: tt.Datum, arrays: dict[str, np.ndarray]) -> None:
    """StableReinforce's ``sampled`` array from the datum's provenance, which must tile its inputs."""
    spans = datum.loss_fn_input_spans
    if spans is None:
        raise UserError(f"datum {i}: stable_reinforce needs provenance on every datum "
                        "(Datum.with_provenance, naming the sampled sequence behind each target); this one "
                        "has none")
    n = datum.model_input.length
    _check_tiling(i, "loss_fn_input_spans", spans, n)
    if datum.model_input_spans is not None:
        _check_tiling(i, "model_input_spans", datum.model_input_spans, n)
    sampled = np.zeros(n, dtype=np.float32)
    start = 0
    # Invariant: the runs before this one cover positions [0, start).
    for span in spans:
        if isinstance(span, tt.SampledProvenanceSpan):
            sampled[start:start + span.length] = 1.0
        start += span.length
    arrays[SAMPLED] = sampled


def _check_tiling(i: int, field: str, spans: tt.ProvenanceSpans, n: int) -> None:
    total = sum(span.length for span in spans)
    if total != n:
        raise UserError(f"datum {i}: {field} cover {total} positions, the datum has {n}: the runs must "
                        "tile it exactly")
