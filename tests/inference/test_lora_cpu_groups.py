"""The grouped CPU LoRA ops (lora_cpu_groups) against vLLM's own per-token PyTorch ops.

One function at a time, on random weights: each group's product must equal what vLLM's
``bgmv_*`` ops compute for the same rows (fp32), and rows of slot -1 must get no delta (vLLM's ops
give them the last slot's). The whole engine's answers with these ops installed are compared with
transformers + the adapters in test_vllm_tokenformer.py and test_lora_logits_vllm.py.
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from loopline.inference.lora_cpu_groups import adapter_rank, expand, shrink, token_groups

needs_vllm = pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")

SLOTS, RANK, HIDDEN, OUT = 3, 8, 24, 40


# The adapters' own ranks; vLLM pads each slot's matrices with zeros to RANK (max_lora_rank).
RANKS = {0: 3, 1: RANK, 2: 5}


def weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g)
    b = torch.randn(SLOTS, 1, OUT, RANK, generator=g)
    for slot, rank in RANKS.items():
        a[slot, :, rank:] = 0
        b[slot, :, :, rank:] = 0
    return a, b


def test_token_groups_one_slot_is_the_whole_batch_and_minus_one_is_left_out():
    assert token_groups(torch.tensor([-1, -1])) == ()
    assert token_groups(torch.tensor([2, 2, 2])) == ((2, None, None),)
    assert token_groups(torch.tensor([2, 2]), {2: 5}) == ((2, None, 5),)
    groups = token_groups(torch.tensor([0, -1, 2, 0]), {0: 3})
    assert [(slot, rank) for slot, _, rank in groups] == [(0, 3), (2, None)]
    assert groups[0][1].tolist() == [0, 3] and groups[1][1].tolist() == [2]


def test_an_adapters_rank_is_its_widest_b():
    from types import SimpleNamespace

    layer = SimpleNamespace  # vLLM's LoRALayerWeights: lora_b a tensor, or a list for packed layers
    model = SimpleNamespace(loras={"q": layer(lora_b=torch.zeros(40, 8)),
                                   "qkv": layer(lora_b=[torch.zeros(16, 12), None, torch.zeros(4, 12)])})
    assert adapter_rank(model) == 12
    assert adapter_rank(SimpleNamespace(loras={})) is None


@needs_vllm
@pytest.mark.parametrize("indices", [[1, 1, 1, 1, 1], [2, 2, 2], [0, 2, 2, 1, 0], [2, -1, 0, -1, 2]])
@pytest.mark.parametrize("known_ranks", [True, False])
def test_shrink_then_expand_equal_vllms_ops_on_adapter_rows(indices, known_ranks):
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    a, b = weights(len(indices) + sum(indices))
    idx = torch.tensor(indices)
    x = torch.randn(len(indices), HIDDEN, generator=torch.Generator().manual_seed(7))
    y0 = torch.randn(len(indices), OUT + 6, generator=torch.Generator().manual_seed(8))
    groups = token_groups(idx, RANKS if known_ranks else None)

    ours_buffer = torch.full((len(indices), RANK), 99.0)  # shrink overwrites, as vLLM's op does
    shrink(ours_buffer, x, a, 0.5, groups)
    ours = y0.clone()
    expand(ours[:, 3:3 + OUT], ours_buffer, b, groups)

    theirs_buffer = torch.zeros(len(indices), RANK)
    bgmv_shrink(x, a, theirs_buffer, idx, 0.5)
    theirs = y0.clone()
    bgmv_expand_slice(theirs_buffer, b, theirs, idx, 3, OUT, add_inputs=True)

    adapter_rows = idx >= 0
    torch.testing.assert_close(ours[adapter_rows], theirs[adapter_rows], rtol=1e-5, atol=1e-5)
    # Slot -1 is "no adapter": its rows keep the base output (vLLM's op adds the last slot's delta).
    torch.testing.assert_close(ours[~adapter_rows], y0[~adapter_rows])
    assert torch.equal(ours_buffer[~adapter_rows], torch.zeros_like(ours_buffer[~adapter_rows]))


@needs_vllm
def test_expand_updates_only_the_columns_the_adapter_has():
    from vllm.lora.ops.torch_ops import bgmv_expand

    _, b = weights(3)
    idx = torch.tensor([0, 1, 1])
    x = torch.randn(3, RANK)
    for width in (OUT - 5, OUT + 5):  # the layer's output narrower / wider than B (vocab padding)
        ours, theirs = torch.zeros(3, width), torch.zeros(3, width)
        expand(ours, x, b, token_groups(idx))
        bgmv_expand(x, b, theirs, idx, add_inputs=True)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@needs_vllm
def test_vllms_plugin_loader_installs_the_grouped_ops():
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    for name in ("update_metadata", "_apply_shrink", "_apply_expand", "add_lora_embedding"):
        assert hasattr(getattr(PunicaWrapperCPU, name), "__loopline_original__"), name
    assert hasattr(LoRAModelManager.activate_adapter, "__loopline_original__")
