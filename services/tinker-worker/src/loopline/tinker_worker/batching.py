"""A forward_backward call's data as padded tensors, split into micro-batches that fit in memory.

Every Tinker loss is a sum over tokens, so a call can run in any grouping: each micro-batch's
backward adds its part of the gradient, and the parts sum to the whole call's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinker import types as tt
from torch import Tensor

from .losses import TARGETS, Loss, fill_value

# The logits of a micro-batch (tokens x vocab, float32) are its largest tensor, and their gradient
# doubles it: budget about 1 GiB for them. The tiny model (vocab 1024) fits 262k tokens, a
# 152k-vocab Qwen about 1.7k; a datum longer than the budget runs alone.
LOGITS_BUDGET_BYTES = 1 << 30
# The activations kept for the backward pass weigh more than the logits on a small-vocab model:
# 8 x 256 tokens of SmolLM2 (vocab 49k, so 5.4k tokens by the logits budget) in one micro-batch
# peaked at 6.9 GB resident (bench/tinker.py). At most this many tokens a micro-batch, whatever
# the vocabulary; the result is the same (every loss is a sum).
MAX_MICRO_BATCH_TOKENS = 1024
# Soft targets pad every row of a micro-batch to its widest K: one datum of K = 152k among 1023 of
# K = 1 made (1024, 1, 152k) targets, 1.2 GB, from a request of 155k cells. At most this many
# padded target cells a token of the budget (a datum wider alone runs alone: its own cells are
# bounded by LOOPLINE_TINKER_MAX_REQUEST_BYTES); top-K distillation's K of 20-64 never reaches it.
MAX_PADDED_WIDTH = 1024


def default_micro_batch_tokens(vocab_size: int) -> int:
    return max(1, min(MAX_MICRO_BATCH_TOKENS, LOGITS_BUDGET_BYTES // (4 * vocab_size)))


def micro_batches(lengths: list[int], max_tokens: int, widths: list[int] | None = None) -> list[list[int]]:
    """Datum indices grouped so that (datums x longest) <= max_tokens and, with each datum's soft
    target width (1: hard targets), (datums x longest x widest) <= max_tokens x MAX_PADDED_WIDTH;
    longest first (less padding); every index appears exactly once."""
    widths = widths or [1] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], -widths[i], i))
    groups: list[list[int]] = []
    widest = 0
    # Invariant: each finished group fits both budgets or holds a single datum; the group being
    # filled is groups[-1], whose longest datum is its first (the order is by falling length), and
    # widest is its widest datum's width.
    for i in order:
        if groups:
            rows, longest, wide = len(groups[-1]) + 1, lengths[groups[-1][0]], max(widest, widths[i])
            if rows * longest <= max_tokens and rows * longest * wide <= max_tokens * MAX_PADDED_WIDTH:
                groups[-1].append(i)
                widest = wide
                continue
        groups.append([i])
        widest = widths[i]
    return groups


def width_of(arrays: dict[str, np.ndarray]) -> int:
    """A datum's soft target width K (1 for (n,) targets): what a micro-batch pads its rows to."""
    targets = arrays[TARGETS]
    return int(targets.shape[1]) if targets.ndim == 2 else 1


@dataclass
class Batch:
    indices: list[int]  # which datums of the call, in row order
    lengths: list[int]
    input_ids: Tensor  # (b, T) int64, right-padded with 0
    attention_mask: Tensor  # (b, T) int64, 1 on real tokens
    targets: Tensor  # (b, T) int64, or (b, T, K) when a datum has soft targets
    inputs: dict[str, Tensor]  # the loss's other inputs, float32, the shape of targets
    widths: list[int | None]  # each datum's K (None: its targets are (n,))

    @property
    def soft(self) -> bool:
        return self.targets.dim() == 3

    @property
    def real(self) -> Tensor:
        return self.attention_mask.bool()


def build(indices: list[int], data: list[tt.Datum], arrays: list[dict[str, np.ndarray]], loss: Loss,
          config: dict[str, float], device: torch.device) -> Batch:
    """Right padding: with a causal model a real token never attends to a pad after it, so each row
    computes exactly what it would alone. When a datum has (n, K) soft targets the batch's are
    (b, T, K) with K the widest: narrower datums, and (n,) ones in column 0, are padded with target
    0 and every input 0 (weight 0: a padded cell adds nothing to a cross-entropy)."""
    lengths = [data[i].model_input.length for i in indices]
    widths = [int(arrays[i][TARGETS].shape[1]) if arrays[i][TARGETS].ndim == 2 else None for i in indices]
    rows, width = len(indices), max(lengths)
    k = max((w for w in widths if w is not None), default=None)
    cells = (rows, width) if k is None else (rows, width, k)
    ids = np.zeros((rows, width), dtype=np.int64)
    attention = np.zeros((rows, width), dtype=np.int64)
    targets = np.zeros(cells, dtype=np.int64)
    keys = [key for key in (*loss.required, *loss.optional, *loss.derived) if key != TARGETS]
    inputs = {key: np.zeros(cells, dtype=np.float32) for key in keys}
    for row, (i, n, w) in enumerate(zip(indices, lengths, widths, strict=True)):
        ids[row, :n] = data[i].model_input.to_ints()
        attention[row, :n] = 1
        # Where this datum's values go: (row, :n) alone, or its (n, w) block of the (b, T, K) cells.
        at = (row, slice(0, n)) if k is None else (row, slice(0, n), slice(0, w) if w is not None else 0)
        targets[at] = arrays[i][TARGETS]
        for key in keys:
            inputs[key][at] = arrays[i][key] if key in arrays[i] else fill_value(loss, config, key)

    def tensor(a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).to(device)

    return Batch(indices, lengths, tensor(ids), tensor(attention), tensor(targets),
                 {key: tensor(v) for key, v in inputs.items()}, widths)
