"""Tokenformer adapters served by vLLM's multi-LoRA machinery (docs/adapter-format.md, "Serving in vLLM").

A Tokenformer adapter on ``y = W x`` adds ``Θ(x Kᵀ) V``: LoRA's shrink (``A = K``, rank n), the
nonlinearity Θ, then LoRA's expand (``B = Vᵀ``, with Θ's √n folded in by ``adapters_vllm``). vLLM
already gives LoRA everything else we need: per-token adapter slots, so one batch mixes adapters;
a slot cache; run-time loading. This module adds the one missing piece, Θ between shrink and
expand for the tokens whose slot holds a Tokenformer adapter, by patching vLLM in place:

1. ``WorkerLoRAManager._load_adapter``: after vLLM loads a folder, read its adapter_config.json;
   ``adapter_type == "tokenformer"`` tags the loaded ``LoRAModel`` (and checks it can be served).
2. ``LoRAModelManager._add_adapter``: keeps the set of registered adapter ids that are Tokenformer.
3. ``LoRAModelManager.set_adapter_mapping`` (runs before every forward, after vLLM has placed the
   batch's adapters into slots and built the per-token slot indices): turns "which slot holds a
   Tokenformer" into per-token masks held by each punica wrapper, in persistent buffers.
4. The punica wrapper's ``add_expand`` (its class is swapped for a subclass when the manager
   creates it): applies Θ to the shrink result of the masked tokens before the expand. Every
   linear LoRA path reaches the expand through ``add_expand`` with the complete scores: the plain
   ``add_lora_linear`` (CPU and GPU wrappers), the dual-stream path, and the fully sharded layers
   (after their all-gather / all-reduce of the shrink). Merged layers (qkv_proj, gate_up_proj) pass
   one shrink result per slice, so Θ normalises each slice over its own n columns.
5. ``PEFTHelper._init_is_supported`` accepts the ``init_lora_weights`` guard that converted folders
   carry, which vLLM without this plugin rejects (so a Tokenformer is never served as a LoRA).

The same masks also zero the shrink result of tokens that use no adapter (slot -1). vLLM's
PyTorch (CPU) punica ops index the stacked weights with -1, i.e. the *last* slot, so without this a
base-model request batched beside an adapter held in the last slot would get that adapter's delta.

Loaded as a ``vllm.general_plugins`` entry point (services/inference/pyproject.toml), so it is
installed in every vLLM process, the EngineCore and workers included. It changes nothing while no
Tokenformer adapter is loaded except that base-model fix; ``LOOPLINE_TOKENFORMER=0`` turns it off.
``register`` also installs ``lora_logits_vllm`` (LoRA on the unembedding for prompt logprobs) and
``lora_targets`` (LoRA on the unembedding of Qwen2, Mistral and Gemma 3), which the switch leaves
on: without the first, prompt logprobs on an adapter can kill the engine.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loopline.common.contracts import adapter_format
from loopline.ml.adapters.tokenformer import TOKENFORMER_EPS

log = logging.getLogger(__name__)

ENV_SWITCH = "LOOPLINE_TOKENFORMER"
_TAG = "loopline_tokenformer"  # attribute set on a vLLM LoRAModel that is a Tokenformer
_installed = False
_lock = threading.Lock()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it once in every process it starts."""
    from loopline.inference import lora_cpu_groups, lora_logits_vllm, lora_targets

    try:  # not a Tokenformer matter: LoRA prompt logprobs crash the engine without it
        lora_logits_vllm.install()
    except Exception:
        log.exception("prompt-logprobs LoRA fix not installed: prompt logprobs on adapters may fail")
    try:  # nor this: LoRA on CPU by adapter rather than by token (the speed of RL sampling)
        lora_cpu_groups.install()
    except Exception:
        log.exception("grouped CPU LoRA ops not installed: LoRA on CPU keeps vLLM's per-token ops")
    try:  # nor this: the unembedding's LoRA on Qwen2, Mistral and Gemma 3 (Tinker's default)
        lora_targets.install()
    except Exception:
        log.exception("lm_head LoRA for %s not installed: such adapters will be refused",
                      sorted(lora_targets.LM_HEAD_LORA_ADDED))
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("Tokenformer plugin disabled by %s", ENV_SWITCH)
        return
    try:
        install()
    except Exception:  # a plugin that fails must not take base-model serving down
        # Safe to go on: without the patch vLLM refuses converted Tokenformer folders (the
        # init_lora_weights guard), so no Tokenformer is served wrongly; LoRA and base still work.
        log.exception("Tokenformer plugin not installed: Tokenformer adapters will be refused")


def install() -> None:
    """Patch vLLM (idempotent). Raises if this vLLM lacks the hooks, rather than serving wrongly."""
    global _installed
    with _lock:
        if _installed:
            return
        from vllm.lora import model_manager, peft_helper, worker_manager
        from vllm.v1.worker import worker_base

        manager_cls = model_manager.LoRAModelManager
        for cls, names in ((manager_cls, ("_init_punica_wrapper", "_add_adapter", "set_adapter_mapping")),
                           (worker_manager.WorkerLoRAManager, ("_load_adapter",)),
                           (peft_helper.PEFTHelper, ("_init_is_supported",)),
                           (worker_base.WorkerBase, ("__init__",))):
            missing = [n for n in names if not callable(getattr(cls, n, None))]
            if missing:
                raise RuntimeError(f"this vLLM has no {cls.__name__}.{missing}: the Tokenformer plugin "
                                   "needs updating for it")
        _wrap(manager_cls, "_init_punica_wrapper", _after_init_punica_wrapper)
        _wrap(manager_cls, "_add_adapter", _after_add_adapter)
        _wrap(manager_cls, "set_adapter_mapping", _after_set_adapter_mapping)
        _wrap(worker_manager.WorkerLoRAManager, "_load_adapter", _after_load_adapter)
        _patch_init_guard(peft_helper.PEFTHelper)
        # Lets a client read the batch statistics from the worker process:
        # ``await async_llm.collective_rpc("loopline_tokenformer_stats")``.
        worker_base.WorkerBase.loopline_tokenformer_stats = _worker_stats  # type: ignore[attr-defined]
        _installed = True
        log.info("Tokenformer plugin installed")


def _wrap(cls: type, name: str, after) -> None:
    """Replace ``cls.name`` by: call the original, then ``after(self, result, *args)``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        after(self, result, *args, **kwargs)
        return result

    wrapper.__loopline_original__ = original  # type: ignore[attr-defined]  # the unpatched method
    setattr(cls, name, wrapper)


# --- Θ ---------------------------------------------------------------------------------------


def theta_unscaled(scores):
    """GeLU(s) / max(‖GeLU(s)‖₂, eps) over the last axis: ml's ``tokenformer_theta`` without its √n.

    √n is in vLLM's B (``adapters_vllm``): the rows here are padded to ``max_lora_rank`` and mix
    adapters of different n, so n is not known here; padding adds GeLU(0) = 0 to the norm.
    """
    s = scores.float()
    g = F.gelu(s)  # exact (erf) GeLU, as the reference
    norm = torch.linalg.vector_norm(g, ord=2, dim=-1, keepdim=True).clamp_min(TOKENFORMER_EPS)
    return (g / norm).to(scores.dtype)


def _theta_wrapper_class_body(base: type[Any]) -> dict:
    """A subclass of the platform's punica wrapper class whose ``add_expand`` applies Θ first.

    The masks are persistent buffers refreshed in place before each forward, so a captured CUDA
    graph or a compiled graph reads the current batch's masks. While tracing or capturing, the
    where() is always applied (a Python branch would be frozen at trace time); in eager mode it is
    skipped when no adapter is resident at all. (A plain subclass, not a mixin: CPython only lets
    an existing object's ``__class__`` be swapped for a class with the identical layout.)
    """
    base_expand = base.add_expand

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
        x = _between_shrink_and_expand(self, x)
        return base_expand(self, y, x, lora_b_stacked, output_slices, offset_start, add_inputs, **kwargs)

    add_expand.__doc__ = base_expand.__doc__
    return {"add_expand": add_expand, "_ll_active": False, "_ll_any_theta": False, "__module__": __name__}


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _between_shrink_and_expand(wrapper, x):
    tracing = _tracing()
    if not wrapper._ll_active and not tracing:
        return x
    theta = tracing or wrapper._ll_any_theta  # eager, LoRA only: skip computing Θ at all
    if isinstance(x, (tuple, list)):  # CPU add_lora_linear: one [tokens, rank] buffer per slice
        return tuple(_apply_masks(wrapper, b, theta) for b in x)
    return _apply_masks(wrapper, x, theta)  # [slices, tokens, rank] (GPU, sharded layers) or [tokens, rank]


def _apply_masks(wrapper, buf, theta: bool):
    n = buf.shape[-2]
    out = buf
    if theta:
        out = torch.where(wrapper._ll_theta_mask[:n].unsqueeze(-1), theta_unscaled(buf), buf)
    adapter_rows = wrapper._ll_adapter_mask[:n].unsqueeze(-1)
    return torch.where(adapter_rows, out, torch.zeros((), dtype=out.dtype, device=out.device))


# --- hooks ----------------------------------------------------------------------------------


@functools.cache
def _theta_class(base: type) -> type:
    return type(f"Tokenformer{base.__name__}", (base,), _theta_wrapper_class_body(base))


def _wrappers(manager) -> list:
    seen, out = set(), []
    for w in manager.punica_wrapper_mapping.values():
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def _after_init_punica_wrapper(manager, _result, *args, **kwargs) -> None:
    manager._ll_tokenformer_ids = set()
    for w in _wrappers(manager):
        w.__class__ = _theta_class(type(w))  # type: ignore[arg-type]  # mypy: type[Any] is not Hashable
        size = w._token_lora_indices.shape[0]  # vLLM's own per-token buffer: same capacity
        w._ll_theta_mask = torch.zeros(size, dtype=torch.bool, device=w.device)
        w._ll_adapter_mask = torch.zeros(size, dtype=torch.bool, device=w.device)
        w._ll_active = False
        w._ll_any_theta = False


def _after_add_adapter(manager, _result, lora, *args, **kwargs) -> None:
    # Every registration (first load, reload in place, reload after eviction) passes here, so the
    # set always describes the adapter now registered under each id.
    manager._ll_tokenformer_ids.discard(lora.id)
    if not getattr(lora, _TAG, False):
        return
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    # Names are vLLM's now (q/k/v packed into qkv_proj): check the layer each one lands in.
    # Embeddings and lm_head go through add_lora_embedding / add_lora_logits, MoE experts through
    # fused kernels: none reaches add_expand, so Θ would be skipped. Refuse instead.
    bad = [name for name in lora.loras
           if name in manager.modules and not isinstance(manager.modules[name], BaseLinearLayerWithLoRA)]
    if bad:
        manager._registered_adapters.pop(lora.id, None)
        raise ValueError(f"Tokenformer adapter {lora.id} targets {bad}: vLLM can serve Tokenformer on "
                         "linear layers only (not embeddings, lm_head or MoE experts)")
    manager._ll_tokenformer_ids.add(lora.id)


def _after_set_adapter_mapping(manager, _result, mapping, *args, **kwargs) -> None:
    """Per-token masks from the slot layout, recomputed before every forward.

    Derived from ``lora_index_to_id`` (vLLM's slot table) each time rather than maintained in
    activate/deactivate, because slots also change without those (remove_all_adapters, an
    in-place reload into the same slot while the mapping is unchanged).
    """
    tf_ids = manager._ll_tokenformer_ids
    slots = manager.lora_index_to_id
    # One entry per slot plus a final False that token index -1 (no adapter) picks.
    slot_is_tf = [lora_id is not None and lora_id in tf_ids for lora_id in slots] + [False]
    active = any(lora_id is not None for lora_id in slots)
    any_theta = any(slot_is_tf)
    for w in _wrappers(manager):
        n = w.indices_len[0]
        if n is None:  # this wrapper has never had a mapping (e.g. an unused tower wrapper)
            continue
        idx = w._token_lora_indices[:n]
        table = torch.tensor(slot_is_tf, dtype=torch.bool).to(w.device, non_blocking=True)
        w._ll_theta_mask[:n].copy_(table[idx])
        w._ll_adapter_mask[:n].copy_(idx >= 0)
        w._ll_active = active
        w._ll_any_theta = any_theta
    _STATS.record(mapping, tf_ids, slots)


def _after_load_adapter(worker_manager, lora, lora_request, *args, **kwargs) -> None:
    from vllm.lora.utils import get_adapter_absolute_path

    from loopline.inference.adapters_vllm import TOKENFORMER_INIT

    path = Path(get_adapter_absolute_path(lora_request.lora_path)) / adapter_format.CONFIG_FILE
    config = json.loads(path.read_text())
    is_tf = config.get("adapter_type") == "tokenformer"
    if config.get("init_lora_weights") == TOKENFORMER_INIT and not is_tf:
        raise ValueError(f"{path}: init_lora_weights={TOKENFORMER_INIT!r} without adapter_type "
                         "'tokenformer'; write the folder with loopline.inference.adapters_vllm.to_vllm_lora")
    if is_tf:
        if not config.get("tokenformer_sqrt_n_folded_into_lora_b"):
            raise ValueError(f"{path}: a Tokenformer checkpoint, not a converted folder; "
                             "convert it with loopline.inference.adapters_vllm.to_vllm_lora")
        _check_servable(worker_manager, lora, path)
    setattr(lora, _TAG, is_tf)


def _check_servable(worker_manager, lora, path: Path) -> None:
    """Refuse what the Θ hook cannot serve exactly, instead of serving it wrongly (the layer types
    are checked when the adapter is registered, ``_after_add_adapter``)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() > 1 and not worker_manager.lora_config.fully_sharded_loras:
        # Row-parallel layers (o_proj, down_proj) then shrink partial sums on each rank and add the
        # expanded results: right for LoRA (linear), wrong for Θ. Fully sharded layers all-reduce
        # the shrink before the expand.
        raise ValueError(f"{path}: Tokenformer with tensor parallelism needs fully_sharded_loras=True")


def _patch_init_guard(peft_helper_cls: type[Any]) -> None:
    from loopline.inference.adapters_vllm import TOKENFORMER_INIT

    original = peft_helper_cls._init_is_supported

    @functools.wraps(original)
    def _init_is_supported(self) -> bool:
        return self.init_lora_weights == TOKENFORMER_INIT or original(self)

    _init_is_supported.__loopline_original__ = original  # type: ignore[attr-defined]  # for the tests
    peft_helper_cls._init_is_supported = _init_is_supported


# --- evidence of mixed batches ----------------------------------------------------------------


class _BatchStats:
    """What each forward mixed: adapter ids per forward (0 = base model) and the slot table, kept
    for the last few forwards that mixed more than one.

    Lives in the process that runs the model (the EngineCore, or a worker): read it there with
    ``batch_stats()`` or from the client with ``collective_rpc("loopline_tokenformer_stats")``.
    """

    def __init__(self, keep: int = 512):
        self.lock = threading.Lock()
        self.keep = keep
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.forwards = 0
            self.max_adapters = 0
            self.max_tokenformers = 0
            self.recent: collections.deque = collections.deque(maxlen=self.keep)

    def record(self, mapping, tf_ids: set[int], slots) -> None:
        # Plain ints: the snapshot crosses vLLM's msgpack RPC, which refuses numpy scalars.
        ids = {int(i) for i in set(mapping.index_mapping)}
        tf = sum(1 for i in ids if i in tf_ids)
        with self.lock:
            self.forwards += 1
            self.max_adapters = max(self.max_adapters, len(ids - {0}))
            self.max_tokenformers = max(self.max_tokenformers, tf)
            if len(ids) > 1:
                self.recent.append({"ids": sorted(ids), "tokenformer_ids": sorted(ids & tf_ids),
                                    "tokens": len(mapping.index_mapping),
                                    # adapter id held by each slot (0: empty)
                                    "slots": [int(i or 0) for i in slots]})

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"forwards": self.forwards, "max_adapters_in_one_forward": self.max_adapters,
                    "max_tokenformers_in_one_forward": self.max_tokenformers,
                    "mixed_forwards": list(self.recent)}


_STATS = _BatchStats()


def batch_stats(reset: bool = False) -> dict[str, Any]:
    snap = _STATS.snapshot()
    if reset:
        _STATS.reset()
    return snap


def _worker_stats(self, reset: bool = False) -> dict[str, Any]:
    return batch_stats(reset)
