"""The on-disk adapter format (docs/adapter-format.md, names in loopline.common.contracts.adapter_format):
one folder, a JSON config, one safetensors file.

Used by the training program to write checkpoints and by inference code to apply them.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loopline.common.contracts.adapter_format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    WEIGHTS_FILE,
    adapter_type_of,
)

from .lora import add_lora, load_lora_tensors, lora_config_dict, lora_config_from_dict, lora_state_dict
from .tokenformer import add_tokenformer, tokenformer_state_dict


def read_adapter_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The folder's adapter_config.json; ``adapter_type`` is always present in the result."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    data = json.loads(path.read_text())
    kind = adapter_type_of(data)
    if kind is None:
        raise ValueError(f"{path}: unknown adapter_type {data.get('adapter_type')!r}")
    data["adapter_type"] = kind
    return data


def adapter_tensors(model: nn.Module, adapter_type: str) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint keeps: the trainable ones, under their on-disk names."""
    if adapter_type == "tokenformer":
        return tokenformer_state_dict(model)
    if adapter_type == "lora":
        return lora_state_dict(model)
    # Full fine-tune: every parameter. named_parameters() lists a tied weight once (the embedding),
    # which is also what safetensors needs: it refuses two names for one storage.
    return {name: p.detach() for name, p in model.named_parameters()}


def adapter_config(model: nn.Module, adapter_type: str, *, base_model: str,
                   extra: dict[str, Any]) -> dict[str, Any]:
    """The adapter_config.json of a model ``prepare_model`` prepared; ``extra``: the fields it
    returned."""
    fields = lora_config_dict(model) if adapter_type == "lora" else {}
    return config_json(adapter_type, {**fields, **extra}, base_model=base_model)


def config_json(adapter_type: str, fields: dict[str, Any], *, base_model: str) -> dict[str, Any]:
    """An adapter_config.json: the adapter's own fields (a LoRA's are PEFT's, ``lora_config_json``,
    so that PEFT and vLLM load it as theirs) and the fields every adapter of ours has. The one place
    its content is put together, for the training program's checkpoints and the Tinker session
    worker's saves alike; ``write_adapter`` writes it."""
    return {**fields, "adapter_type": adapter_type, "format_version": FORMAT_VERSION,
            "base_model_name_or_path": base_model}


def write_adapter(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write the two adapter files into ``out_dir`` (an existing, private temp folder): the one
    writer of adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    # contiguous() + clone: safetensors wants dense tensors that own their memory.
    weights = out_dir / WEIGHTS_FILE
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(weights),
              metadata={"format": "pt"})
    config_file = out_dir / CONFIG_FILE
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # safetensors 0.8 creates its file 0600 whatever the umask; the checkpoint-watcher reads it as
    # another user when a job runs as a uid of its own (group access to a 2750 job folder). As
    # readable as the config file, i.e. as the umask says.
    os.chmod(weights, stat.S_IMODE(config_file.stat().st_mode))


def read_tensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(checkpoint_dir) / WEIGHTS_FILE))


def load_full_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load a full fine-tune's weights; only tied duplicates (e.g. lm_head) may be absent."""
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"weights that fit no parameter of the model: {result.unexpected_keys[:5]}")
    names = {name for name, _ in model.named_parameters()}
    missing = [k for k in result.missing_keys if k in names]
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")


def load_tokenformer_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected = set(tokenformer_state_dict(model))
    if set(tensors) != expected:
        raise ValueError(
            f"Tokenformer tensors do not match the model: missing {sorted(expected - set(tensors))[:5]}, "
            f"unexpected {sorted(set(tensors) - expected)[:5]}"
        )
    model.load_state_dict(tensors, strict=False)


def apply_adapter(model: nn.Module, checkpoint_dir: str | Path, *, merge_lora: bool = True) -> nn.Module:
    """Apply a checkpoint of any kind to a base HF model and return the adapted model in eval mode.

    Tokenformer and full weights change ``model`` in place. LoRA is merged into the base weights by
    default, so the result is again the plain model class (set ``merge_lora=False`` to keep PEFT's
    unmerged wrapper, which computes ``W x + B A x`` as vLLM does).
    """
    config = read_adapter_config(checkpoint_dir)
    tensors = read_tensors(checkpoint_dir)
    kind = config["adapter_type"]
    if kind == "tokenformer":
        add_tokenformer(model, config["num_tokens"], config["target_modules"])
        load_tokenformer_tensors(model, tensors)
    elif kind == "lora":
        from peft import get_peft_model

        peft_model = get_peft_model(model, lora_config_from_dict(config))
        load_lora_tensors(peft_model, tensors)
        model = peft_model.merge_and_unload() if merge_lora else peft_model
    else:
        load_full_tensors(model, tensors)
    return model.eval()


def prepare_model(model: nn.Module, adapter_type: str, *, tokenformer: dict[str, Any], lora: dict[str, Any],
                  base_model: str, seed: int,
                  lora_task_type: str = "CAUSAL_LM") -> tuple[nn.Module, dict[str, Any]]:
    """Add a fresh adapter for training; returns the model and the config fields it adds.

    Everything but the adapter is frozen (for "none" nothing is). ``lora_task_type``: PEFT's task
    type, "FEATURE_EXTRACTION" for a bare model trained as an embedder.
    """
    if adapter_type == "tokenformer":
        for p in model.parameters():
            p.requires_grad_(False)
        modules = add_tokenformer(model, tokenformer["num_tokens"], tokenformer["target_modules"], seed=seed)
        targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
        return model, {"num_tokens": tokenformer["num_tokens"], "target_modules": targets}
    if adapter_type == "lora":
        return add_lora(model, base_model_name_or_path=base_model, task_type=lora_task_type, **lora), {}
    if adapter_type == "none":
        for p in model.parameters():
            p.requires_grad_(True)
        return model, {}
    raise ValueError(f"unknown adapter_type {adapter_type!r}")


def load_adapter_tensors(model: nn.Module, adapter_type: str, tensors: dict[str, torch.Tensor]) -> None:
    """Put checkpoint tensors back into a model prepared by ``prepare_model`` (for resuming)."""
    if adapter_type == "tokenformer":
        load_tokenformer_tensors(model, tensors)
    elif adapter_type == "lora":
        load_lora_tensors(model, tensors)
    else:
        load_full_tensors(model, tensors)
