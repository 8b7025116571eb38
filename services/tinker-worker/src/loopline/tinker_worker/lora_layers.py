"""Many LoRA adapters on one resident model: each targeted ``nn.Linear`` is wrapped once, and the
wrapper holds every training client's A and B for that layer; only the active client's are applied.

The math is PEFT's LoRA, ``y = W x + (alpha / r) * B (A x)``, A initialised as PEFT does
(Kaiming-uniform, a = sqrt(5)) but from a seeded generator, B zero: a fresh adapter is the base
model. Tensors are named as PEFT saves them (``base_model.model.<module>.lora_A.weight``), so a saved
adapter is a PEFT LoRA folder that PEFT and vLLM load. Not PEFT's own multi-adapter model: its
``delete_adapter`` leaves a PeftModel that cannot run once the last adapter is gone (PEFT 0.21), and
a worker adds and drops clients all day.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from loopline.common.contracts.tinker_schemas import LoraSpec

from .types import UserError

# Tinker's LoRA alpha: its LoraConfig carries only the rank. 32 is the constant of "LoRA Without
# Regret" (thinkingmachines.ai/blog/lora, alpha 32 with 1/r scaling), and what SkyRL's Tinker server
# fills in (skyrl/tinker/api.py: "alpha = 32 seems to be the tinker default").
LORA_ALPHA = 32.0
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
ALL_TARGETS = ATTN + MLP + UNEMBED
PEFT_PREFIX = "base_model.model."


def target_leaves(spec: LoraSpec) -> tuple[str, ...]:
    """The module names a LoraSpec trains (Llama/Qwen/Mistral naming)."""
    leaves = (ATTN if spec.train_attn else ()) + (MLP if spec.train_mlp else ()) + (
        UNEMBED if spec.train_unembed else ())
    if not leaves:
        raise UserError("the LoRA config trains nothing: set at least one of train_attn, train_mlp, "
                        "train_unembed")
    return leaves


class MultiLoraLinear(nn.Module):
    """A frozen linear layer plus each client's low-rank update, keyed by adapter name."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base  # keeps a tied weight (lm_head = embeddings) shared
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        self.scales: dict[str, float] = {}
        self.active: str | None = None
        # Several clients in one pass: (adapter, first row, end row) spans covering the batch in
        # order, each span's rows through its own adapter; None: ``active`` for every row.
        self.rows: tuple[tuple[str | None, int, int], ...] | None = None

    def add(self, name: str, rank: int, generator: torch.Generator) -> tuple[nn.Parameter, nn.Parameter]:
        weight = self.base.weight
        a = torch.empty(rank, self.base.in_features, dtype=weight.dtype)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_a[name] = nn.Parameter(a.to(weight.device))
        self.lora_b[name] = nn.Parameter(torch.zeros(self.base.out_features, rank, dtype=weight.dtype,
                                                     device=weight.device))
        self.scales[name] = LORA_ALPHA / rank
        return self.lora_a[name], self.lora_b[name]

    def remove(self, name: str) -> None:
        if name in self.scales:
            del self.lora_a[name], self.lora_b[name], self.scales[name]

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        if self.rows is not None:
            parts = [self._update(name, x[start:end], out[start:end]) for name, start, end in self.rows]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._update(self.active, x, out)

    def _update(self, name: str | None, x: Tensor, out: Tensor) -> Tensor:
        if name is None or name not in self.scales:
            return out
        return out + self.scales[name] * ((x @ self.lora_a[name].T) @ self.lora_b[name].T)


def wrap_targets(model: nn.Module) -> dict[str, MultiLoraLinear]:
    """Wrap every linear layer a LoraSpec can target, once (layers wrapped already are reused);
    returns the wrappers by module path."""
    found = [(path, module) for path, module in model.named_modules()
             if path.rsplit(".", 1)[-1] in ALL_TARGETS and isinstance(module, nn.Linear | MultiLoraLinear)]
    wrapped = {}
    for path, module in found:
        if isinstance(module, MultiLoraLinear):
            wrapped[path] = module
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapper = MultiLoraLinear(module)
        setattr(parent, leaf, wrapper)
        wrapped[path] = wrapper
    return wrapped


def peft_names(path: str) -> tuple[str, str]:
    """PEFT's saved names of one module's A and B (the adapter name dropped, as PEFT saves)."""
    return f"{PEFT_PREFIX}{path}.lora_A.weight", f"{PEFT_PREFIX}{path}.lora_B.weight"


def set_active(layers: dict[str, MultiLoraLinear], name: str | None) -> None:
    for layer in layers.values():
        layer.active, layer.rows = name, None


def set_rows(layers: dict[str, MultiLoraLinear], spans: list[tuple[str, int, int]]) -> None:
    """Each span's batch rows through its adapter (spans in row order, covering the batch)."""
    rows = tuple(spans)
    for layer in layers.values():
        layer.active, layer.rows = None, rows


def tensor_dict(layers: dict[str, MultiLoraLinear], name: str) -> dict[str, Tensor]:
    """One adapter's tensors under PEFT's names (detached, on the CPU)."""
    out = {}
    for path, layer in sorted(layers.items()):
        if name in layer.scales:
            a_name, b_name = peft_names(path)
            out[a_name] = layer.lora_a[name].detach().cpu()
            out[b_name] = layer.lora_b[name].detach().cpu()
    return out


def load_tensors(layers: dict[str, MultiLoraLinear], name: str, tensors: dict[str, Tensor]) -> None:
    """Copy saved tensors into an adapter of the same shape; UserError if they do not fit it."""
    expected = {}
    for path, layer in layers.items():
        if name in layer.scales:
            a_name, b_name = peft_names(path)
            expected[a_name], expected[b_name] = layer.lora_a[name], layer.lora_b[name]
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise UserError(f"the checkpoint's LoRA tensors do not fit this model's adapter: missing "
                        f"{missing[:3]}, unexpected {extra[:3]}")
    for key, param in expected.items():  # all checked before any is copied: no half-loaded adapter
        if tuple(tensors[key].shape) != tuple(param.shape):
            raise UserError(f"the checkpoint's {key} has shape {tuple(tensors[key].shape)}, this "
                            f"model's adapter {tuple(param.shape)}")
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(tensors[key])
