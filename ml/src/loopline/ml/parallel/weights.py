"""HF safetensors in (each rank keeps its shard), full HF-named tensors out (gathered from the shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from .llama import TensorParallelLlama
from .sharding import to_full, to_local

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def safetensors_files(model_path: str | Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, for a single file or a sharded (indexed) checkpoint."""
    folder = Path(model_path)
    if (folder / INDEX_NAME).is_file():
        index = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        return {name: folder / file for name, file in index.items()}
    if (folder / SINGLE_NAME).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE_NAME), framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / SINGLE_NAME)
    raise FileNotFoundError(f"{folder}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors checkpoints load)")


@torch.no_grad()
def load_hf_weights(model: TensorParallelLlama, model_path: str | Path) -> None:
    """Fill every parameter with this rank's part of the HF weight of the same name.

    One full tensor is in memory at a time (per rank), never the whole model.
    """
    from safetensors import safe_open

    where = safetensors_files(model_path)
    missing = [name for name, _ in model.named_parameters() if name not in where]
    if missing:
        raise ValueError(f"{model_path}: weights missing from the checkpoint: {missing[:5]}")
    handles = {}
    try:
        for name, param in model.named_parameters():
            path = where[name]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt").__enter__()
            full = handles[path].get_tensor(name).to(param.dtype)
            local = to_local(full, model.shards[name], model.tp_rank, model.tp)
            if local.shape != param.shape:
                raise ValueError(f"{name}: shard {tuple(local.shape)} does not fit parameter "
                                 f"{tuple(param.shape)}")
            param.copy_(local)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


@torch.no_grad()
def gather_hf_state_dict(model: TensorParallelLlama) -> dict[str, torch.Tensor]:
    """Every parameter whole, under its HF name, on the CPU (collective: all TP ranks call it).

    A tied LM head is not listed (HF's own full-weights checkpoints leave it out too).
    """
    out = {}
    for name, param in model.named_parameters():
        shard = model.shards[name]
        pieces: list[torch.Tensor] = [param]
        if shard.dim is not None and model.tp > 1:
            pieces = [torch.empty_like(param) for _ in range(model.tp)]
            dist.all_gather(pieces, param.detach().contiguous(), group=model.tp_group)
        out[name] = to_full([p.detach().cpu() for p in pieces], shard).contiguous()
    return out
