"""megatron-core's pieces we use, imported in one place.

Its import warns that Apex and Transformer Engine are missing; we use neither (no fused kernels,
no distributed optimizer), so those warnings are silenced here and nowhere else.
"""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

__all__ = [
    "ColumnParallelLinear",
    "ModelParallelConfig",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "parallel_state",
    "vocab_parallel_cross_entropy",
]
