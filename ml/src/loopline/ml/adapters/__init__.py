"""Adapters in Loopline's one on-disk format: Tokenformer, LoRA (PEFT) and full weights ("none").

Torch-only, so inference code can import it: ``apply_adapter(model, checkpoint_dir)``.
"""

from .io import apply_adapter, read_adapter_config
from .tokenformer import TokenformerLinear, add_tokenformer, tokenformer_delta, tokenformer_theta

__all__ = [
    "TokenformerLinear",
    "add_tokenformer",
    "apply_adapter",
    "read_adapter_config",
    "tokenformer_delta",
    "tokenformer_theta",
]
