"""LoRA on CPU computed per adapter, not per token (a vLLM 0.32 CPU speed fix, issue 26).

vLLM's PyTorch LoRA ops (vllm/lora/ops/torch_ops, what ``PunicaWrapperCPU`` calls) compute every
token's delta as ``einsum("bi,boi->bo", x, W[indices])``: they first gather one copy of the
token's adapter matrix per token (``[tokens, rank, hidden]``), then do a batched matrix-vector
product. For SmolLM2's prefill of one RL iteration's 1,084 prompt tokens at rank 64 that is
160 MB copied per projection per layer, and a matrix-vector product where a matrix product would
do: the cookbook's arithmetic recipe sampled a few dozen tokens a second on a 135M model.

Here the step's tokens are grouped by adapter slot once, when vLLM sets the step's LoRA mapping
(``update_metadata``), and each projection does one matrix product per adapter in the batch (the
whole batch at once when it is a single adapter, the usual case in an RL loop). The result is the
same product, summed in the same fp32 buffer vLLM uses. Each product goes through
``row_invariant_mm``, so a row's bits do not depend on how many rows share its adapter in the step:
without it, Loopline's replica and ``vllm serve`` batching the same requests differently disagreed
in the 7th digit of a logprob (tests/e2e/test_vllm_parity_adapters.py compares them bit for bit).

Slot -1 means "no adapter". vLLM's PyTorch ops index with it, which takes the *last* slot's
weights; the gather here skips it, so a base-model row in a batch with adapters gets no delta (see
lora_logits_vllm.py, which does the same for the unembedding).

Only the calls whose rows are the step's tokens take this path; anything else (rows that do not
match the mapping, ``add_inputs=False``) goes to vLLM's own code. GPUs have their own (Triton)
kernels and are left alone. Installed by the ``loopline_tokenformer`` vLLM plugin in every vLLM
process; the Tokenformer patch's Θ between shrink and expand is unaffected (it wraps
``add_expand``, which calls the per-slice methods patched here).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import torch

from loopline.inference.row_products import row_invariant_mm

log = logging.getLogger(__name__)

# (slot, rows, rank) per adapter in the step; rows is None when the slot has every row of the step,
# rank None when the adapter's rank is not known (its weights are then used at the padded rank).
Groups = tuple[tuple[int, torch.Tensor | None, int | None], ...]

_lock = threading.Lock()
_installed = False
_HOOKS = ("update_metadata", "_apply_shrink", "_apply_expand", "add_lora_embedding")
_SLOT_RANKS = "_ll_slot_ranks"  # on a punica wrapper: slot -> the rank of the adapter in it


def install() -> None:
    """Patch vLLM's CPU punica wrapper (idempotent; nothing on other platforms). Raises if this
    vLLM lacks the hooks."""
    global _installed
    with _lock:
        if _installed:
            return
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            _installed = True
            return
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

        missing = [name for name in _HOOKS if not callable(getattr(PunicaWrapperCPU, name, None))]
        if missing:
            raise RuntimeError(f"this vLLM's PunicaWrapperCPU has no {missing}: the grouped LoRA ops "
                               "need updating for it")
        from vllm.lora.model_manager import LoRAModelManager

        if not callable(getattr(LoRAModelManager, "activate_adapter", None)):
            raise RuntimeError("this vLLM's LoRAModelManager has no activate_adapter: the grouped "
                               "LoRA ops need updating for it")
        _patch(PunicaWrapperCPU)
        _patch_activation(LoRAModelManager)
        _installed = True
        log.info("grouped CPU LoRA ops installed on %s", PunicaWrapperCPU.__name__)


def token_groups(indices: torch.Tensor, ranks: dict[int, int] | None = None) -> Groups:
    """The rows of each adapter slot in ``indices`` (one slot per token), slot -1 left out, with the
    rank of the adapter in each slot where ``ranks`` knows it."""
    ranks = ranks or {}
    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        return () if slots[0] < 0 else ((slots[0], None, ranks.get(slots[0])),)
    return tuple((slot, (indices == slot).nonzero().squeeze(1), ranks.get(slot))
                 for slot in slots if slot >= 0)


def adapter_rank(lora_model: Any) -> int | None:
    """The largest rank among a vLLM ``LoRAModel``'s layers, from their B matrices ([out, rank]:
    the rank is the last axis for linear layers, embeddings and the unembedding alike)."""
    ranks = []
    for weights in lora_model.loras.values():
        b = weights.lora_b
        for part in b if isinstance(b, list | tuple) else [b]:
            if isinstance(part, torch.Tensor) and part.dim() >= 2:
                ranks.append(int(part.shape[-1]))
    return max(ranks) if ranks else None


def shrink(y: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, scale: float,
           groups: Groups) -> None:
    """``y[i] = scale · x[i] A[s]ᵀ`` for the rows of each group (``A = weights[s, 0]``, [rank, in],
    zero-padded beyond the adapter's rank), 0 for rows in none and beyond the rank."""
    y.zero_()
    for slot, rows, rank in groups:
        a = weights[slot, 0, :rank].to(y.dtype)
        picked = x if rows is None else x.index_select(0, rows)
        product = row_invariant_mm(picked.to(y.dtype), a.t()) * scale
        if rows is None:
            y[:, :a.shape[0]] = product
        else:
            y[:, :a.shape[0]].index_copy_(0, rows, product)


def expand(y: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, groups: Groups) -> None:
    """``y[i] += x[i] B[s]ᵀ`` for the rows of each group (``B = weights[s, 0]``, [out, rank]); ``y``
    may be narrower or wider than ``B`` (vocabulary padding): the common columns are updated."""
    width = min(weights.shape[-2], y.shape[1])
    out = y[:, :width]
    for slot, rows, rank in groups:
        b = weights[slot, 0, :width, :rank].to(y.dtype)
        picked = x if rows is None else x.index_select(0, rows)
        product = row_invariant_mm(picked[:, :b.shape[1]].to(y.dtype), b.t())
        if rows is None:
            out.add_(product)
        else:
            out.index_add_(0, rows, product)


def _patch(cls: type[Any]) -> None:
    update_metadata = cls.update_metadata
    apply_shrink, apply_expand, add_lora_embedding = (
        cls._apply_shrink, cls._apply_expand, cls.add_lora_embedding)

    @functools.wraps(update_metadata)
    def update_metadata_grouped(self, *args, **kwargs):
        update_metadata(self, *args, **kwargs)
        indices = self.token_lora_indices
        self._ll_rows = indices.shape[0]
        self._ll_groups = token_groups(indices, getattr(self, _SLOT_RANKS, None))

    def groups_for(self, rows: int) -> Groups | None:
        return self._ll_groups if getattr(self, "_ll_rows", None) == rows else None

    @functools.wraps(apply_shrink)
    def _apply_shrink(self, y, x, w_t_all, scale):
        groups = groups_for(self, x.shape[0])
        if groups is None or y.dim() != 2:
            return apply_shrink(self, y, x, w_t_all, scale)
        shrink(y, x, w_t_all, scale, groups)

    @functools.wraps(apply_expand)
    def _apply_expand(self, y, x, w_t_all, y_offset, y_slice_size, add_inputs=True):
        groups = groups_for(self, x.shape[0])
        if groups is None or not add_inputs or y.shape[0] != x.shape[0]:
            return apply_expand(self, y, x, w_t_all, y_offset, y_slice_size, add_inputs)
        expand(y[:, y_offset:y_offset + y_slice_size], x, w_t_all, groups)

    @functools.wraps(add_lora_embedding)
    def add_lora_embedding_grouped(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        groups = groups_for(self, x.shape[0])
        if groups is None or not add_inputs or y.shape[0] != x.shape[0]:
            return add_lora_embedding(self, y, x, lora_b_stacked, add_inputs, **kwargs)
        expand(y, x, lora_b_stacked, groups)
        return None

    for name, fn, original in (("update_metadata", update_metadata_grouped, update_metadata),
                               ("_apply_shrink", _apply_shrink, apply_shrink),
                               ("_apply_expand", _apply_expand, apply_expand),
                               ("add_lora_embedding", add_lora_embedding_grouped, add_lora_embedding)):
        fn.__loopline_original__ = original  # type: ignore[attr-defined]
        setattr(cls, name, fn)


def _patch_activation(cls: type[Any]) -> None:
    """Note each slot's adapter rank on the manager's wrappers when an adapter is put in a slot
    (``activate_adapter`` is where vLLM 0.32 writes a slot's weights, and the only place)."""
    original = cls.activate_adapter

    @functools.wraps(original)
    def activate_adapter(self, lora_id, *args, **kwargs):
        placed = original(self, lora_id, *args, **kwargs)
        if placed:
            index = self.lora_index_to_id.index(lora_id)
            rank = adapter_rank(self._registered_adapters[lora_id])
            for wrapper in {id(w): w for w in self.punica_wrapper_mapping.values()}.values():
                ranks = wrapper.__dict__.setdefault(_SLOT_RANKS, {})
                if rank is None:
                    ranks.pop(index, None)
                else:
                    ranks[index] = rank
        return placed

    activate_adapter.__loopline_original__ = original  # type: ignore[attr-defined]
    cls.activate_adapter = activate_adapter
