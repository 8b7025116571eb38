"""Tokenformer adapters: learnable parameter tokens attached to linear layers (arXiv 2410.23168;
format in docs/adapter-format.md).

For a target linear layer ``y = W x + b`` the adapted layer computes ``y + tokenformer_delta(x, K, V)``
with ``n`` key tokens ``K`` [n, d_in] and value tokens ``V`` [n, d_out]. ``tokenformer_delta`` is
the single definition of the formula: the vLLM side reimplements it and is checked against it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from loopline.common.contracts.train_params import TOKENFORMER_TARGET_MODULES

# Floor on the L2 norm in Θ, so an all-zero score row (e.g. x = 0) gives a zero delta, not NaN.
TOKENFORMER_EPS = 1e-6

K_LEAF, V_LEAF = "tokenformer_k", "tokenformer_v"


def tokenformer_theta(scores: torch.Tensor) -> torch.Tensor:
    """Θ(s) = √n · GeLU(s) / max(‖GeLU(s)‖₂, eps), the norm taken over the last (token) axis.

    GeLU is the exact (erf) one. The √n keeps each weight O(1) whatever n is, and because it is a
    plain scalar outside the norm, a server may fold it into V (zero-padded slots add nothing to
    the norm since GeLU(0) = 0).
    """
    n = scores.shape[-1]
    g = F.gelu(scores)
    norm = torch.linalg.vector_norm(g, ord=2, dim=-1, keepdim=True).clamp_min(TOKENFORMER_EPS)
    return g * (math.sqrt(n) / norm)


def tokenformer_delta(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The adapter's contribution for input ``x`` [..., d_in]: ``Θ(x Kᵀ) V`` [..., d_out].

    The math runs in the parameters' dtype (float32 in training) and the result is cast back to
    ``x``'s dtype, so a bf16 base model still gets an fp32 adapter computation.
    """
    scores = x.to(k.dtype) @ k.t()
    return (tokenformer_theta(scores) @ v).to(x.dtype)


class TokenformerLinear(nn.Module):
    """A linear layer plus Tokenformer parameter tokens.

    It takes over the wrapped layer's own ``weight``/``bias`` Parameters (no copy), so the base
    tensors keep their state-dict names and the adapter tensors sit beside them as
    ``<module path>.tokenformer_k`` / ``.tokenformer_v``.
    """

    def __init__(self, base: nn.Linear, num_tokens: int, *, generator: torch.Generator | None = None):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dtype = torch.float32 if base.weight.dtype in (torch.float16, torch.bfloat16) else base.weight.dtype
        device = base.weight.device
        # K: std 1/√d_in makes the scores x·k about as large as the (normalised) activations, so
        # GeLU works in its nonlinear range from the start. V = 0: a fresh adapter is the base model.
        k = torch.randn(num_tokens, self.in_features, generator=generator, dtype=torch.float32)
        self.tokenformer_k = nn.Parameter((k / math.sqrt(self.in_features)).to(device=device, dtype=dtype))
        v = torch.zeros(num_tokens, self.out_features, device=device, dtype=dtype)
        self.tokenformer_v = nn.Parameter(v)

    @property
    def num_tokens(self) -> int:
        return self.tokenformer_k.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        return base + tokenformer_delta(x, self.tokenformer_k, self.tokenformer_v)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"num_tokens={self.num_tokens}")


def add_tokenformer(
    model: nn.Module, num_tokens: int, target_modules: Iterable[str] = TOKENFORMER_TARGET_MODULES, *,
    seed: int = 0,
) -> list[str]:
    """Replace every ``nn.Linear`` whose last name component is in ``target_modules``, in place.

    Returns the full module paths that were wrapped (sorted). Raises if none matched, since an
    adapter that touches nothing would silently train nothing.
    """
    targets = set(target_modules)
    # K's init comes from its own generator so it does not depend on (or disturb) the global RNG.
    generator = torch.Generator().manual_seed(seed)
    matched = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    if not matched:
        raise ValueError(f"no nn.Linear module is named one of {sorted(targets)}; cannot add Tokenformer")
    for name, module in matched:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, TokenformerLinear(module, num_tokens, generator=generator))
    return sorted(name for name, _ in matched)


def tokenformer_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, named ``<module path>.tokenformer_{k,v}``."""
    return {
        name: p.detach()
        for name, p in model.named_parameters()
        if name.rsplit(".", 1)[-1] in (K_LEAF, V_LEAF)
    }
