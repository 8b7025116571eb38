"""How each HF weight is split across the tensor-parallel ranks, and put back together.

A sharded tensor is cut into equal contiguous slices along ``dim``, slice r on TP rank r (what
megatron-core's column/row-parallel layers and vocab-parallel embedding expect). A replicated one
(norms, row-parallel biases) is whole on every rank. Two Llama details need more than a chunk():

* GQA with fewer KV heads than ranks (the tiny model: 1 KV head at TP=2). Every rank needs the KV
  head its query heads attend with, so k/v are expanded first, each HF head repeated
  ``head_repeat`` times, and that is split: the ranks sharing a head hold identical copies. Their
  gradients are partial (each rank's query heads only) and are summed across the copies before the
  optimizer step (grads.py), so the copies stay equal and the update is the TP=1 update.
* A vocabulary that does not divide by the TP size: the embedding rows are zero-padded to the next
  multiple (the padded logits are masked to -inf-ish in the model, so the loss is unchanged).

Pure torch on purpose: weights.py and the tests use it without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    dim: int | None  # the dimension split across ranks; None: every rank holds the whole tensor
    head_repeat: int = 1  # k/v only: copies of each HF head before splitting (KV heads < TP)
    head_size: int = 0  # k/v only: rows per head along dim 0
    vocab_rows: int = 0  # embedding/LM head only: the real row count, padded up to a multiple of TP

    def copies(self, tp: int) -> int:
        """On how many ranks each value lives: the grad norm divides by it to count each once."""
        return tp if self.dim is None else self.head_repeat


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def to_local(full: torch.Tensor, shard: Shard, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of an HF tensor."""
    if shard.dim is None:
        return full.clone()
    if shard.head_repeat > 1:
        heads = full.unflatten(0, (-1, shard.head_size))
        full = heads.repeat_interleave(shard.head_repeat, dim=0).flatten(0, 1)
    if shard.vocab_rows:
        rows = padded_vocab(shard.vocab_rows, tp)
        full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])
    if full.shape[shard.dim] % tp:
        raise ValueError(f"dimension {shard.dim} of shape {tuple(full.shape)} does not divide by TP={tp}")
    return full.chunk(tp, dim=shard.dim)[rank].clone()


def to_full(pieces: list[torch.Tensor], shard: Shard) -> torch.Tensor:
    """The HF tensor from every rank's part, in rank order (the inverse of ``to_local``)."""
    if shard.dim is None:
        return pieces[0]
    full = torch.cat(pieces, dim=shard.dim)
    if shard.vocab_rows:
        full = full[: shard.vocab_rows]
    if shard.head_repeat > 1:
        # The copies are equal (their gradients are summed), so the first of each run is the head.
        full = full.unflatten(0, (-1, shard.head_repeat, shard.head_size))[:, 0].flatten(0, 1)
    return full
