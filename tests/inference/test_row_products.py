"""row_invariant_mm: a row's bits do not depend on the rows computed beside it (row_products.py)."""

from __future__ import annotations

import pytest
import torch

from loopline.inference.row_products import row_invariant_mm

# The LoRA shapes of the tiny model and SmolLM2 (shrink: hidden -> rank, expand: rank -> out).
SHAPES = [(576, 8), (576, 64), (64, 576), (8, 1536), (32, 4096), (1536, 32)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_a_row_is_the_same_in_any_number_of_rows(k: int, n: int, threads: int):
    gen = torch.Generator().manual_seed(k * n)
    x, w_t = torch.randn(64, k, generator=gen), torch.randn(k, n, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reference = row_invariant_mm(x, w_t)
        for rows in range(1, 41):
            together = row_invariant_mm(x[:rows], w_t)
            for i in range(rows):
                assert torch.equal(together[i], reference[i]), f"row {i} of {rows}"
            alone = row_invariant_mm(x[rows - 1:rows], w_t)
            assert torch.equal(alone[0], reference[rows - 1]), f"row {rows - 1} alone"
    finally:
        torch.set_num_threads(before)


def test_it_is_the_product():
    x, w_t = torch.randn(3, 16), torch.randn(16, 5)
    assert torch.allclose(row_invariant_mm(x, w_t), x @ w_t, atol=1e-5)
    assert row_invariant_mm(x[:0], w_t).shape == (0, 5)
