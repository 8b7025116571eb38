"""Gradients across the TP ranks: summing the partial ones of copied KV heads, and the clip norm.

What each rank holds after backward:
* a sharded parameter (column/row slices, vocab slices): the full gradient of its own slice;
* a replicated one (norm weights, row-parallel biases): the full gradient, equal on every rank
  (its inputs and output gradients are the all-reduced, identical activations; megatron relies on
  the same), so nothing is exchanged for it;
* a copied KV head (fewer KV heads than ranks): only the part from this rank's query heads, so the
  copies' gradients are summed before anything reads them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .llama import TensorParallelLlama


def sum_kv_copy_grads(model: TensorParallelLlama) -> None:
    if model.kv_replica_group is None:
        return
    for name, param in model.named_parameters():
        if model.shards[name].head_repeat > 1 and param.grad is not None:
            dist.all_reduce(param.grad, group=model.kv_replica_group)


def clip_grad_norm(model: TensorParallelLlama, max_norm: float) -> float:
    """The global L2 norm of all gradients, as one unsplit model has it; scale them to ``max_norm``.

    Each rank adds its squared norms, divided by the number of ranks holding the same values
    (TP for replicated tensors, the copy count for KV heads), so the all-reduced sum counts every
    value once. ``max_norm <= 0`` only measures. Same formula as torch.nn.utils.clip_grad_norm_.
    """
    grads = [(p.grad, model.shards[name].copies(model.tp)) for name, p in model.named_parameters()
             if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grad, copies in grads:
        squares += grad.float().pow(2).sum() / copies
    if model.tp > 1:
        dist.all_reduce(squares, group=model.tp_group)
    norm = float(squares.sqrt())
    if max_norm > 0 and math.isfinite(norm):
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for grad, _ in grads:
                grad.mul_(scale)
    return norm
