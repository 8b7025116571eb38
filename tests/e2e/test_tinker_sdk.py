"""The unmodified ``tinker==0.38.0`` SDK against a whole Loopline stack on the tiny model.

The stack is the real one: gateway, queue, an inference replica (vLLM), the trainer (its local
launcher starts the session worker), the checkpoint-watcher. What is checked is what a Tinker
user sees: the SkyRL tx README's Pig Latin loop learns and its sampler answers a trained example;
the sampler's logprobs agree with the training worker's forward pass (importance sampling is only
right if they do); a user error fails fast; saved state comes back.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tinker import types

# The SkyRL tx README's examples (the Tinker docs' quick start).
EXAMPLES = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
    {"input": "donut shop", "output": "onut-day op-shay"},
    {"input": "pickle jar", "output": "ickle-pay ar-jay"},
    {"input": "space exploration", "output": "ace-spay exploration-way"},
    {"input": "rubber duck", "output": "ubber-ray uck-day"},
    {"input": "coding wizard", "output": "oding-cay izard-way"},
]
# The README's loop takes 6 steps at 1e-4 on an 8B+ model; the tiny random model needs more, larger
# steps to memorise (it learns 3 prompt-completion pairs exactly in ~50 AdamW steps at 1e-2, about
# 1 s on this CPU). Only these two numbers differ.
STEPS, LEARNING_RATE = 40, 1e-2


def process_example(example: dict, tokenizer) -> types.Datum:
    # As the README writes it.
    prompt = f"English: {example['input']}\nPig Latin:"
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
    prompt_weights = [0] * len(prompt_tokens)
    completion_tokens = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
    completion_weights = [1] * len(completion_tokens)
    tokens = prompt_tokens + completion_tokens
    weights = prompt_weights + completion_weights
    input_tokens = tokens[:-1]
    target_tokens = tokens[1:]
    weights = weights[1:]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens=input_tokens),
                       loss_fn_inputs=dict(weights=weights, target_tokens=target_tokens))  # noqa: C408


@pytest.fixture(scope="module")
def trained(service, tiny):
    """The README's loop: returns (training client, tokenizer, per-step losses, sampling client)."""
    training_client = service.create_lora_training_client(base_model=tiny)
    tokenizer = training_client.get_tokenizer()
    processed = [process_example(ex, tokenizer) for ex in EXAMPLES]
    losses = []
    for _ in range(STEPS):
        fwdbwd_future = training_client.forward_backward(processed, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        fwdbwd_result = fwdbwd_future.result()
        optim_future.result()
        logprobs = np.concatenate([output["logprobs"].tolist() for output in fwdbwd_result.loss_fn_outputs])
        weights = np.concatenate([example.loss_fn_inputs["weights"].tolist() for example in processed])
        losses.append(-np.dot(logprobs, weights) / weights.sum())
    sampling_client = training_client.save_weights_and_get_sampling_client(name="pig-latin-model")
    return training_client, tokenizer, losses, sampling_client


def test_pig_latin_loss_falls_and_the_sampler_answers_a_trained_example(trained):
    _, tokenizer, losses, sampling_client = trained
    assert losses[-1] < 0.1 * losses[0], losses
    prompt = types.ModelInput.from_ints(tokenizer.encode("English: banana split\nPig Latin:"))
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
    result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=2).result()
    assert len(result.sequences) == 2
    for sequence in result.sequences:
        text = tokenizer.decode(sequence.tokens)
        assert text.startswith(" anana-bay plit-say"), text
        assert sequence.stop_reason == "stop"
        assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens)


def test_sampler_logprobs_agree_with_the_training_forward_pass(trained):
    """Importance sampling divides by the sampler's logprobs: vLLM's must be the trainer's."""
    training_client, tokenizer, _, sampling_client = trained
    prompt_tokens = tokenizer.encode("English: donut shop\nPig Latin:")
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    prompt = types.ModelInput.from_ints(prompt_tokens)
    result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=1).result()
    sequence = result.sequences[0]
    tokens = prompt_tokens + list(sequence.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    forward = training_client.forward([datum], "cross_entropy").result()
    trained_logprobs = forward.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt_tokens) - 1:]
    assert np.allclose(trained_logprobs, sequence.logprobs, atol=1e-3), \
        np.max(np.abs(np.array(trained_logprobs) - np.array(sequence.logprobs)))


def test_a_user_error_fails_fast(service, tiny):
    # A client of its own: a failed call poisons the client it was made on (the SDK's rule).
    training_client = service.create_lora_training_client(base_model=tiny, rank=4)
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4]})
    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        training_client.forward_backward([datum], "no_such_loss").result()
    assert "no_such_loss" in str(failure.value)
    assert time.monotonic() - started < 20
