"""Which served models take a LoRA on ``lm_head`` (Tinker's ``train_unembed``), as the replica reads it
from the installed vLLM (inference/lora_targets.py) and writes it into its deployment record.

The families are tiny configs built with transformers' own config classes on the tiny tokenizer; the
architecture is the one transformers writes into a saved model's config.json, and the class is the
one vLLM's registry serves it with. Llama and Qwen3 take a LoRA on ``lm_head`` in vLLM's own class;
Qwen2, Mistral and Gemma 3 take it through ``lora_targets.install`` (tests/e2e/test_families.py
samples such adapters); Gemma 2 does not (vLLM answers every sample of such an adapter with a 422).
One family goes through the whole path a replica takes: a model folder, vLLM's ``ModelConfig`` of it,
the resolved class.
"""

from __future__ import annotations

import pytest

from loopline.inference.lora_targets import lm_head_lora, served_architecture

# family -> (transformers config class name, whether vLLM serves a LoRA on lm_head)
FAMILIES = {
    "llama": ("LlamaConfig", True),
    "qwen3": ("Qwen3Config", True),
    "qwen2": ("Qwen2Config", True),
    "mistral": ("MistralConfig", True),
    "gemma3": ("Gemma3TextConfig", True),
    "gemma2": ("Gemma2Config", False),
}


def tiny_config(config_class: str, vocab_size: int):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = getattr(transformers, config_class)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    # What save_pretrained of the model transformers builds for this config writes.
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lm_head_lora_is_read_from_vllms_model_class(family):
    from vllm.model_executor.models import ModelRegistry

    config_class, takes_lm_head = FAMILIES[family]
    (architecture,) = tiny_config(config_class, 1024).architectures
    model_cls = ModelRegistry.models[architecture].load_model_cls()
    assert lm_head_lora(model_cls) is takes_lm_head, (architecture, model_cls.embedding_modules)


def test_a_replica_reads_it_from_its_engines_model_config(tmp_path):
    from vllm.config import ModelConfig

    from loopline.ml.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tiny_config("MistralConfig", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model_config = ModelConfig(model=str(tmp_path), dtype="float32")
    assert served_architecture(model_config) == ("MistralForCausalLM", True)
