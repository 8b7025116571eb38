"""What a training client's saves hold on disk, beside the adapter folder itself.

An adapter is our adapter format (``adapter_config.json`` + ``adapter_model.safetensors``, a PEFT
LoRA folder vLLM serves). ``save_state`` adds ``lora.json`` (the client's LoraSpec) and
``optimizer.pt`` (AdamW's state, the step count, the parameter names in the order the state lists
them); names from ``tinker_names``. A sampler save has only the adapter: its LoraSpec is read back
from the adapter config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loopline.common.contracts.adapter_format import CONFIG_FILE
from loopline.common.contracts.tinker_names import LORA_FILE, OPTIMIZER_FILE
from loopline.common.contracts.tinker_schemas import LoraSpec
from loopline.ml.adapters.io import config_json, read_adapter_config
from loopline.ml.adapters.lora import lora_config_json

from .lora_layers import ATTN, LORA_ALPHA, MLP, UNEMBED
from .types import UserError


def adapter_config(spec: LoraSpec, targets: list[str], base_model: str) -> dict[str, Any]:
    """adapter_config.json for this LoRA: PEFT's fields for it and our format's, put together by the
    adapter format's own builder (``loopline.ml.adapters.io``, which also writes it)."""
    from peft import LoraConfig

    config = LoraConfig(r=spec.rank, lora_alpha=int(LORA_ALPHA), lora_dropout=0.0, target_modules=targets,
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    return config_json("lora", lora_config_json(config), base_model=base_model)


def write_spec(out_dir: Path, spec: LoraSpec) -> None:
    (out_dir / LORA_FILE).write_text(spec.model_dump_json(indent=2) + "\n")


def read_spec(folder: Path) -> LoraSpec:
    """The LoraSpec a checkpoint folder was trained with: its lora.json, or for a sampler save
    what its adapter config targets."""
    if (folder / LORA_FILE).is_file():
        return LoraSpec.model_validate_json((folder / LORA_FILE).read_text())
    if not (folder / CONFIG_FILE).is_file():
        raise UserError(f"{folder.name}: not a checkpoint (no {LORA_FILE} or {CONFIG_FILE})")
    config = read_adapter_config(folder)
    if config["adapter_type"] != "lora":
        raise UserError(f"{folder.name}: a {config['adapter_type']} adapter, not LoRA")
    targets = set(config.get("target_modules") or ())
    return LoraSpec(rank=int(config["r"]), train_attn=bool(targets & set(ATTN)),
                    train_mlp=bool(targets & set(MLP)), train_unembed=bool(targets & set(UNEMBED)))


def write_optimizer(out_dir: Path, optimizer: torch.optim.Optimizer, steps: int, names: list[str]) -> None:
    state = {"optimizer": optimizer.state_dict(), "steps": steps, "params": names}
    torch.save(state, out_dir / OPTIMIZER_FILE)


def read_optimizer(folder: Path, names: list[str]) -> tuple[dict[str, Any], int]:
    """(AdamW state dict, steps); UserError when the folder has none or it is another model's."""
    path = folder / OPTIMIZER_FILE
    if not path.is_file():
        raise UserError(f"{folder.name} holds no optimizer state: load it without the optimizer")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("params") != names:
        raise UserError(f"{folder.name}: its optimizer state is for other parameters than this model's")
    return saved["optimizer"], int(saved["steps"])
