"""Which layers of the served model vLLM takes a LoRA on, read from vLLM's own model class.

A Tinker client trains the unembedding (``lm_head``) by default (``train_unembed=True``), but vLLM
0.32 serves a LoRA on ``lm_head`` only for the model classes that name it in their
``embedding_modules`` (vllm/lora/utils.py, ``get_supported_lora_modules``: every linear layer, plus
those names); Llama and Qwen3 do, Qwen2, Mistral and Gemma 3 do not, and vLLM answers every sample
of such an adapter with a 422 (``expected target modules in {...} but received ['lm_head']``). The
replica writes the answer into its deployment record, so that the gateway refuses such a training
client when it is created instead of after it has trained.
"""

from __future__ import annotations

from typing import Any


def lm_head_lora(model_cls: type) -> bool:
    """Whether vLLM serves a LoRA on ``lm_head`` for models of ``model_cls`` (a vLLM model class)."""
    from vllm.model_executor.models.interfaces import supports_lora

    return supports_lora(model_cls) and "lm_head" in (getattr(model_cls, "embedding_modules", None) or {})


def served_architecture(model_config: Any) -> tuple[str, bool]:
    """The architecture vLLM resolved for a running engine's ``model_config``, and whether it takes
    a LoRA on ``lm_head``."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_cls, architecture = get_model_architecture(model_config)
    return architecture, lm_head_lora(model_cls)
