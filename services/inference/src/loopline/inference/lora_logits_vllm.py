"""Prompt logprobs on a LoRA engine: the unembedding's LoRA applied per prompt token (a vLLM 0.32 fix).

The crash it fixes (issue 24, Tinker's ``compute_logprobs``): with ``--enable-lora`` vLLM wraps
``lm_head`` in ``LogitsProcessorWithLoRA`` (whether or not any adapter trains it), whose
``add_lora_logits`` picks each logits row's adapter slot from the punica wrapper's
``sampler_indices``: one entry per *sampled* row of the whole batch. The model runner's
``_get_prompt_logprobs_dict`` then calls ``compute_logits`` once per request that asked for
prompt logprobs, on that request's prompt rows only. So the rows and the indices disagree:

- measured (tiny Llama, CPU, one batch of 3 requests, one with ``prompt_logprobs=5`` on a 23-token
  prompt): ``einsum(): subscript b has size 3 for operand 1 which does not broadcast with
  previously seen size 22`` in ``bgmv_shrink``, raised in the EngineCore, which dies; the same
  request alone in its batch works (one index broadcasts over the rows), which is why it is
  intermittent under load;
- where the counts happen to agree (prompt rows == sampled rows) nothing fails but row i gets the
  adapter of the batch's i-th *request*: silently wrong prompt logprobs.

The fix: while ``_get_prompt_logprobs_dict`` runs, ``compute_logits`` is wrapped to note which
rows of the step's hidden states it was given (they are a slice, so its storage offset says
where), and ``add_lora_logits`` then takes those rows' own slots from the per-token indices vLLM
already built for the forward (``_token_lora_indices``: every token of one request has its
request's slot). The delta is computed per slot (rows grouped by adapter: a few small matmuls,
never vLLM's gather of one [vocab, rank] matrix per row, which is GiBs for a long prompt).

Slot -1 means "no adapter": vLLM's PyTorch (CPU) ops index with it, i.e. take the *last* slot's
adapter, so on CPU the sampled rows go through the same per-slot path, which skips -1 (on GPU the
Triton kernels skip -1 themselves and vLLM's own path is kept there).

Installed by the ``loopline_tokenformer`` vLLM plugin (``tokenformer_vllm.register``) in every vLLM
process, whatever ``LOOPLINE_TOKENFORMER`` says.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
from typing import Any

import torch

from loopline.inference.row_products import row_invariant_mm

log = logging.getLogger(__name__)

# (first row, row count) of the hidden states now being turned into prompt logits; None otherwise.
_PROMPT_ROWS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "loopline_prompt_rows", default=None)
_installed = False
_lock = threading.Lock()


def install() -> None:
    """Patch vLLM (idempotent). Raises if this vLLM lacks the hooks."""
    global _installed
    with _lock:
        if _installed:
            return
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        wrapper_cls = resolve_obj_by_qualname(current_platform.get_punica_wrapper())
        for cls, name in ((wrapper_cls, "add_lora_logits"), (GPUModelRunner, "_get_prompt_logprobs_dict")):
            if not callable(getattr(cls, name, None)):
                raise RuntimeError(f"this vLLM has no {cls.__name__}.{name}: the prompt-logprobs LoRA fix "
                                   "needs updating for it")
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

        _patch_add_lora_logits(wrapper_cls, per_slot_always=issubclass(wrapper_cls, PunicaWrapperCPU))
        _patch_prompt_logprobs(GPUModelRunner)
        _installed = True
        log.info("prompt-logprobs LoRA fix installed on %s", wrapper_cls.__name__)


def _patch_prompt_logprobs(runner_cls: type[Any]) -> None:
    original = runner_cls._get_prompt_logprobs_dict

    @functools.wraps(original)
    def _get_prompt_logprobs_dict(self, hidden_states, *args, **kwargs):
        if getattr(self, "lora_config", None) is None or not self.num_prompt_logprobs:
            return original(self, hidden_states, *args, **kwargs)
        model = self.model
        compute_logits = model.compute_logits

        def prompt_compute_logits(rows, *a, **kw):
            token = _PROMPT_ROWS.set(row_span(rows, hidden_states))
            try:
                return compute_logits(rows, *a, **kw)
            finally:
                _PROMPT_ROWS.reset(token)

        # An instance attribute shadows the method for this call only (the loop inside calls
        # ``self.model.compute_logits`` once per request that wants prompt logprobs).
        model.compute_logits = prompt_compute_logits
        try:
            return original(self, hidden_states, *args, **kwargs)
        finally:
            del model.compute_logits

    _get_prompt_logprobs_dict.__loopline_original__ = original  # type: ignore[attr-defined]
    runner_cls._get_prompt_logprobs_dict = _get_prompt_logprobs_dict


def row_span(rows: torch.Tensor, hidden_states: torch.Tensor) -> tuple[int, int]:
    """Where ``rows`` (a slice ``hidden_states[a:b]``) lies in ``hidden_states``: ``(a, b - a)``."""
    same = (rows.untyped_storage().data_ptr() == hidden_states.untyped_storage().data_ptr()
            and rows.dim() == hidden_states.dim() and rows.stride() == hidden_states.stride())
    delta = rows.storage_offset() - hidden_states.storage_offset()
    step = hidden_states.stride(0)
    if not same or delta < 0 or delta % step or delta // step + rows.shape[0] > hidden_states.shape[0]:
        raise RuntimeError("prompt logits rows are not a slice of the step's hidden states: the "
                           "prompt-logprobs LoRA fix needs updating for this vLLM")
    return delta // step, rows.shape[0]


def _patch_add_lora_logits(wrapper_cls: type[Any], *, per_slot_always: bool) -> None:
    original = wrapper_cls.add_lora_logits

    @functools.wraps(original)
    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *args, **kwargs):
        span = _PROMPT_ROWS.get()
        if span is not None:
            start, n = span
            slots = self._token_lora_indices[start:start + n]
        elif (per_slot_always and not torch.compiler.is_compiling()
              and self.sampler_indices.shape[0] == x.view(-1, x.shape[-1]).shape[0]):
            slots = self.sampler_indices
        else:  # GPU (its kernels skip slot -1), or rows vLLM's own path handles as it likes
            return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, *args, **kwargs)
        add_lora_logits_per_slot(y, x, slots, lora_a_stacked, lora_b_stacked, scale)
        return y

    add_lora_logits.__loopline_original__ = original  # type: ignore[attr-defined]
    wrapper_cls.add_lora_logits = add_lora_logits


def add_lora_logits_per_slot(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                             lora_a_stacked: torch.Tensor, lora_b_stacked: torch.Tensor,
                             scale: float) -> None:
    """``y[i] += scale · x[i] A[s]ᵀ B[s]ᵀ`` with ``s = slots[i]``; rows of slot -1 are left alone.

    ``A`` is ``lora_a_stacked[s, 0]`` ([rank, hidden]), ``B`` is ``lora_b_stacked[s, 0]`` ([vocab,
    rank]); the rank product is in fp32, as vLLM's own buffer. ``y`` may be wider than ``B`` (vocab
    padding), as in vLLM's ``bgmv_expand``.
    """
    y2, x2 = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
    if slots.shape[0] != x2.shape[0]:
        raise RuntimeError(f"LoRA logits: {x2.shape[0]} rows but {slots.shape[0]} adapter slots")
    width = min(lora_b_stacked.shape[-2], y2.shape[1])
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        picked = x2.index_select(0, rows).float()
        shrunk = row_invariant_mm(picked, lora_a_stacked[slot, 0].float().t()) * scale
        delta = row_invariant_mm(shrunk, lora_b_stacked[slot, 0, :width].float().t())
        y2[:, :width].index_add_(0, rows, delta.to(y2.dtype))
