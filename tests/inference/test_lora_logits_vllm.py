"""The unembedding's LoRA per row (lora_logits_vllm) on vLLM's CPU punica wrapper, without an engine.

The engine-level regression (top-k prompt logprobs on a LoRA and a Tokenformer in one batch, then
serving goes on) is in test_vllm_tokenformer.py, which shares that module's engine.
"""

from __future__ import annotations

import pytest
import torch

HIDDEN, VOCAB, RANK, SLOTS = 8, 24, 4, 3
SLOT_IDS = [7, 8, 9]  # adapter id held by each slot


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=gen)
    b = torch.randn(SLOTS, 1, VOCAB, RANK, generator=gen)
    return a, b


def _wrapper(token_ids: list[int], request_ids: list[int]):
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from loopline.inference import lora_logits_vllm

    lora_logits_vllm.install()
    wrapper = PunicaWrapperCPU(64, 8, "cpu")
    wrapper.update_metadata(LoRAMapping(tuple(token_ids), tuple(request_ids), is_prefill=True),
                            SLOT_IDS, SLOTS, VOCAB)
    return wrapper


def _expected(x, ids, a, b, scale=1.0):
    y = torch.zeros(len(ids), VOCAB)
    for i, lora_id in enumerate(ids):
        if lora_id:  # 0: the base model, no delta
            s = SLOT_IDS.index(lora_id)
            y[i] = scale * x[i] @ a[s, 0].t() @ b[s, 0].t()
    return y


def test_prompt_rows_take_their_own_requests_adapter(weights):
    """Three requests (9 tokens) in one forward; prompt logits of the second request's 4 tokens.
    vLLM's own path pairs those 4 rows with the 3 per-request indices and fails (the engine
    crash of issue 24)."""
    from loopline.inference import lora_logits_vllm

    a, b = weights
    tokens = [7, 7, 8, 8, 8, 8, 0, 0, 9]
    wrapper = _wrapper(tokens, [7, 8, 9])  # one sampled row per request
    x = torch.randn(len(tokens), HIDDEN, generator=torch.Generator().manual_seed(1))
    rows = x[2:6]
    y = torch.zeros(4, VOCAB)
    original = type(wrapper).add_lora_logits.__loopline_original__
    with pytest.raises(RuntimeError, match="einsum"):
        original(wrapper, y.clone(), rows, a, b, 0.5)

    token = lora_logits_vllm._PROMPT_ROWS.set(lora_logits_vllm.row_span(rows, x))
    try:
        wrapper.add_lora_logits(y, rows, a, b, 0.5)
    finally:
        lora_logits_vllm._PROMPT_ROWS.reset(token)
    assert torch.allclose(y, _expected(rows, tokens[2:6], a, b, 0.5), atol=1e-5)


def test_sampled_rows_of_the_base_model_get_no_adapter(weights):
    """On CPU vLLM indexes slot -1 (no adapter) as the last slot: a base-model row beside an
    adapter held there would get that adapter's unembedding delta."""
    a, b = weights
    requests = [8, 0, 9]  # the base model's row sits beside the adapter in the last slot
    wrapper = _wrapper(requests, requests)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    original = type(wrapper).add_lora_logits.__loopline_original__
    wrong = torch.zeros(3, VOCAB)
    original(wrapper, wrong, x, a, b, 1.0)
    assert wrong[1].abs().max() > 0.1  # vLLM's own op: slot 9's delta on the base row

    y = torch.zeros(3, VOCAB)
    wrapper.add_lora_logits(y, x, a, b, 1.0)
    assert torch.allclose(y, _expected(x, requests, a, b), atol=1e-5)
    assert torch.equal(y[1], torch.zeros(VOCAB))


def test_row_span_refuses_rows_that_are_not_a_slice():
    from loopline.inference.lora_logits_vllm import row_span

    hidden = torch.randn(10, HIDDEN)
    assert row_span(hidden[3:7], hidden) == (3, 4)
    with pytest.raises(RuntimeError, match="not a slice"):
        row_span(hidden[3:7].clone(), hidden)
