"""Matrix products whose every row is the same whatever rows are computed beside it.

A row of ``x @ w`` from PyTorch's CPU fp32 matmul (MKL here) is not always computed the same way:
below 12 rows, the rows past the last multiple of 4 take another path that rounds differently
(the last bit or so; from 12 rows up every row agrees with the same row in any larger product).
Measured on this machine's torch, K and N from 8 to 1,536, 1 and 2 threads;
tests/inference/test_row_products.py holds it to that. The LoRA ops here group a step's rows by
adapter, so a row's group size depends on what else is in the batch: two servers batching the same
requests differently (Loopline's replica, ``vllm serve``) then disagree in the 7th digit of a
logprob. Padding a short product with zero rows to a multiple of 4 keeps every row on the one
path; the padding (at most 3 rows, only under 12) costs nothing measurable against a step's
base-model work.
"""

from __future__ import annotations

import torch

# Products of fewer rows than DIRECT_BELOW are padded to a multiple of BLOCK (see the module doc).
BLOCK = 4
DIRECT_BELOW = 12


def row_invariant_mm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x @ w_t`` ([rows, k] @ [k, n]) with each row's bits independent of the other rows."""
    rows = x.shape[0]
    if rows >= DIRECT_BELOW or rows % BLOCK == 0:
        return x @ w_t
    padded = torch.zeros((-(-rows // BLOCK) * BLOCK, x.shape[1]), dtype=x.dtype, device=x.device)
    padded[:rows] = x
    return (padded @ w_t)[:rows]
