"""Tinker's prompt scoring beyond top-k, through the unmodified SDK on the shared Tinker stack:
``target_prompt_logprobs`` (dense, and sparse as the cookbook's decisions recipe sends it),
``prompt_alt_tokens_k``, and cross-entropy on (N, K) soft targets (the cookbook's sdft). The
sampler's numbers are held against the training worker's forward pass of a fresh adapter (B = 0:
the base model), which computes them another way.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from tinker import types

K = 3


def test_target_logprobs_alt_tokens_and_soft_targets_agree_with_the_trainer(service, tiny):
    training_client = service.create_lora_training_client(base_model=tiny, rank=4, seed=1).result()
    sampling_client = service.create_sampling_client(base_model=tiny).result()
    tokens = training_client.get_tokenizer().encode("The quick brown fox jumps over")
    n = len(tokens) - 1
    # Row i scores position i + 1: the prompt's own token there, and two fixed others.
    ids = torch.tensor([[tokens[i + 1], 7, 42] for i in range(n)], dtype=torch.int64)
    prompt = types.ModelInput.from_ints(tokens)
    answer = sampling_client.sample(
        prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1, temperature=1.0,
                                                                           seed=3),
        include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_torch(ids),
        prompt_alt_tokens_k=2).result()
    target = answer.target_prompt_logprobs.to_numpy()
    assert target.shape == (n, K)
    # Column 0 is the prompt's own token: vLLM's prompt logprobs of it, another path.
    assert np.allclose(target[:, 0], answer.prompt_logprobs[1:], atol=1e-5)

    # The trainer: (N, K) targets on the prompt less its last token give the same (N, K) logprobs.
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(ids)})
    forward = training_client.forward([datum], "cross_entropy").result()
    trained = forward.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert trained.shape == (n, K)
    assert np.allclose(trained, target, atol=1e-3), np.abs(trained - target).max()

    # Soft targets with weights: the loss is -sum(w * logprob) (docs/tinker.md).
    weights = np.random.default_rng(0).dirichlet(np.ones(K), size=n).astype(np.float32)
    soft = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(ids), "weights": types.TensorData.from_numpy(weights)})
    loss = training_client.forward([soft], "cross_entropy").result().metrics["loss:sum"]
    assert abs(loss + float((weights * target).sum())) < 1e-2, loss

    # Alternatives: 2 draws per position, each with the model's logprob of it (temperature 1).
    alt = answer.prompt_alt_tokens
    drawn, drawn_logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert drawn.shape == drawn_logprobs.shape == (n, 2)
    scored = training_client.forward([types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(drawn.astype(np.int64))})],
        "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.allclose(scored, drawn_logprobs, atol=1e-3), np.abs(scored - drawn_logprobs).max()


def test_sparse_targets_as_the_decisions_recipe_sends_them(service, tiny):
    """One row of label ids, -1 elsewhere, sparse CSR: read back with to_torch() at that row."""
    sampling_client = service.create_sampling_client(base_model=tiny).result()
    tokens = list(range(10, 30))
    labels = [101, 102, 103, 104]
    row = len(tokens) - 2  # the last position
    ids = torch.full((len(tokens) - 1, len(labels)), -1, dtype=torch.int64)
    ids[row] = torch.tensor(labels)
    answer = sampling_client.sample(
        prompt=types.ModelInput.from_ints(tokens), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        target_prompt_logprobs=types.TensorData.from_torch_sparse(ids, pad_value=-1)).result()
    scored = answer.target_prompt_logprobs.to_torch()
    assert scored.shape == ids.shape and bool((scored[:row] == 0).all())
    # The same ids as the prompt's own next token, one prompt each: vLLM's prompt logprob of it.
    for j, label in enumerate(labels):
        own = sampling_client.sample(prompt=types.ModelInput.from_ints([*tokens[:-1], label]), num_samples=1,
                                     sampling_params=types.SamplingParams(max_tokens=1),
                                     include_prompt_logprobs=True).result()
        assert abs(own.prompt_logprobs[-1] - float(scored[row, j])) < 1e-4


def test_an_id_outside_the_vocabulary_fails_fast_naming_it(service, tiny):
    """vLLM refuses the prefix request (400): the future fails as a user error at once, and the
    replica serves the next request."""
    sampling_client = service.create_sampling_client(base_model=tiny).result()
    prompt = types.ModelInput.from_ints(list(range(10, 15)))
    ids = torch.full((4, 1), 10**6, dtype=torch.int64)
    started = time.monotonic()
    with pytest.raises(Exception, match="out-of-vocab"):
        sampling_client.sample(prompt=prompt, num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=1),
                               target_prompt_logprobs=types.TensorData.from_torch(ids)).result()
    assert time.monotonic() - started < 20
    answer = sampling_client.sample(prompt=prompt, num_samples=1,
                                    sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert len(answer.sequences[0].tokens) == 2
