"""LoRA through PEFT, saved in PEFT's own format so PEFT and vLLM load our checkpoints as they are."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # PEFT is imported where it is used, so that the other adapter kinds do without it
    from peft import LoraConfig, PeftConfig
    from torch.nn.modules.module import _IncompatibleKeys

ADAPTER_NAME = "default"  # PEFT's name for a model's only adapter; it never appears on disk


def add_lora(model: nn.Module, *, r: int, lora_alpha: float, lora_dropout: float,
             target_modules: str | list[str], base_model_name_or_path: str | None = None,
             task_type: str = "CAUSAL_LM") -> nn.Module:
    """Wrap ``model`` in a PEFT model with one LoRA adapter; only the LoRA tensors are trainable.
    ``task_type`` is PEFT's: "CAUSAL_LM" for a language model, "FEATURE_EXTRACTION" for a bare
    model (an embedder), whose forward takes no labels."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        # PEFT annotates lora_alpha as int but only divides it by r; our contract's alpha is a float.
        lora_alpha=lora_alpha,  # type: ignore[arg-type]
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        bias="none",  # vLLM serves no LoRA biases
        task_type=task_type,
        base_model_name_or_path=base_model_name_or_path,
    )
    return get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def lora_state_dict(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """LoRA tensors under PEFT's saved names (adapter name dropped), e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    from peft.utils import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER_NAME, save_embedding_layers=False)
    return {name: t.detach() for name, t in tensors.items()}


def load_lora_tensors(peft_model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    from peft.utils import set_peft_model_state_dict

    # PEFT annotates its result as `namedtuple` (the factory, not a type); it is the result of torch's
    # Module.load_state_dict, which it returns as it is.
    result: _IncompatibleKeys = set_peft_model_state_dict(peft_model, tensors, adapter_name=ADAPTER_NAME)
    if result.unexpected_keys:
        raise ValueError(f"LoRA tensors that fit no module of the model: {result.unexpected_keys[:5]}")
    lora_missing = [k for k in result.missing_keys if ".lora_" in k]
    if lora_missing:
        raise ValueError(f"LoRA tensors missing from the checkpoint: {lora_missing[:5]}")


def lora_config_dict(peft_model: nn.Module) -> dict[str, Any]:
    """The adapter_config.json content PEFT itself writes for a model (target modules resolved to
    names)."""
    from peft import PeftModel

    if not isinstance(peft_model, PeftModel):
        raise TypeError(f"a LoRA config comes from a PEFT model, not a {type(peft_model).__name__}")
    return lora_config_json(peft_model.peft_config[ADAPTER_NAME])


def lora_config_json(config: PeftConfig) -> dict[str, Any]:
    """The adapter_config.json content PEFT itself writes for ``config``, as JSON values."""
    out = {}
    for key, value in config.to_dict().items():  # PEFT's own: drops the runtime-only fields
        if isinstance(value, set):
            value = sorted(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        out[key] = value
    out["inference_mode"] = True  # what PEFT's save_pretrained writes: a saved adapter is for loading
    return out


def lora_config_from_dict(data: dict[str, Any]) -> LoraConfig:
    """A ``LoraConfig`` from an adapter_config.json, ignoring fields PEFT does not know (ours)."""
    from peft import LoraConfig

    # peft_type is implied by the class; runtime_config is never stored (PEFT drops it too).
    known = {f.name for f in dataclasses.fields(LoraConfig)} - {"peft_type", "runtime_config"}
    return LoraConfig(**{k: v for k, v in data.items() if k in known})
