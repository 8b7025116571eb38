"""The on-disk adapter format (docs/adapter-format.md): what a checkpoint folder holds and how its
type is told. Training writes it (loopline.ml), the checkpoint-watcher checks and stores it, the
inference replicas load it.

One folder, two files: ``adapter_config.json`` (its ``adapter_type``, ``format_version``, the base
model, the type's own fields) and ``adapter_model.safetensors``. Standard library only: the
training program imports it inside a Slurm job, the watcher has no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FILES = (CONFIG_FILE, WEIGHTS_FILE)
FORMAT_VERSION = 1

AdapterType = Literal["tokenformer", "lora", "none"]
ADAPTER_TYPES: tuple[str, ...] = get_args(AdapterType)
# Not an adapter: the checkpoint holds every weight of the model (a full fine-tune).
FULL_WEIGHTS: AdapterType = "none"
# The types that train an adapter beside the frozen base weights; an engine serves them on the base.
FROZEN_BASE_TYPES: tuple[str, ...] = tuple(t for t in ADAPTER_TYPES if t != FULL_WEIGHTS)


def adapter_type_of(config: Mapping[str, Any]) -> str | None:
    """The type an adapter_config.json declares, or None when it names none we know. A plain PEFT
    folder (no field of ours) is LoRA: adapters trained elsewhere are accepted too."""
    kind = config.get("adapter_type") or ("lora" if config.get("peft_type") == "LORA" else None)
    return kind if kind in ADAPTER_TYPES else None
