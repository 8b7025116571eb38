"""The unmodified ``tinker==0.38.0`` SDK against a whole Loopline stack on the tiny model.

The stack is the real one: gateway, queue, an inference replica (vLLM), the trainer (its local
launcher starts the session worker), the checkpoint-watcher. What is checked is what a Tinker
user sees: the SkyRL tx README's Pig Latin loop learns and its sampler answers a trained example;
the sampler's logprobs agree with the training worker's forward pass (importance sampling is only
right if they do), at temperature 0.7 and with top-k too, scaled as Tinker defines them; a user
error fails fast; saved state comes back.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from tinker import types

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo
from support.bus_view import BusView

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


# Tinker's sampled logprobs are those of the distribution each token was drawn from: the logits over
# the temperature, cut to the top k (or top p) and renormalised (docs/tinker.md, "Logprobs").
TEMPERATURE = 0.7


def sample_at(sampling_client, prompt_tokens: list[int], **params):
    params = types.SamplingParams(max_tokens=8, temperature=TEMPERATURE, seed=11, stop=[], **params)
    prompt = types.ModelInput.from_ints(prompt_tokens)
    return sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=1,
                                  topk_sample_logprobs=5).result().sequences[0]


def trainer_scores(training_client, inputs: list[int], targets: list[list[int]]) -> np.ndarray:
    """The trainer's (raw) logprobs of ``targets[j][i]`` after ``inputs[:i + 1]``, as [i, j]."""
    data = [types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={"target_tokens": row})
            for row in targets]
    forward = training_client.forward(data, "cross_entropy").result()
    return np.stack([np.array(out["logprobs"].tolist()) for out in forward.loss_fn_outputs], axis=1)


def test_sampled_logprobs_at_temperature_are_the_trainers_scaled_by_it(trained):
    """The trainer scores every vocabulary token at every position (one datum per token): its
    logprobs over the temperature, renormalised, must be the sampler's; its raw ones (vLLM's
    default) must not be."""
    training_client, tokenizer, _, sampling_client = trained
    prompt_tokens = tokenizer.encode("The quick brown fox")  # untrained: a spread distribution
    sequence = sample_at(sampling_client, prompt_tokens)
    inputs = (prompt_tokens + list(sequence.tokens))[:-1]
    raw = trainer_scores(training_client, inputs, [[token] * len(inputs) for token in range(len(tokenizer))])
    raw = raw[len(prompt_tokens) - 1:]  # [sampled position, vocabulary]
    scaled = raw / TEMPERATURE
    positions = np.arange(len(sequence.tokens))
    expected = scaled[positions, sequence.tokens] - np.logaddexp.reduce(scaled, axis=1)
    assert np.allclose(expected, sequence.logprobs, atol=2e-3), (expected, sequence.logprobs)
    assert not np.allclose(raw[positions, sequence.tokens], sequence.logprobs, atol=2e-2)


def test_sampled_logprobs_with_top_k_are_renormalised_over_the_top_k(trained):
    """With top_k=5 the sampled token is one of the 5 the sampler reports, and its logprob is the
    trainer's over the temperature, renormalised over those 5."""
    training_client, tokenizer, _, sampling_client = trained
    prompt_tokens = tokenizer.encode("The quick brown fox")
    sequence = sample_at(sampling_client, prompt_tokens, top_k=5)
    top = np.array(sequence.topk_logprobs_np.token_ids)  # [sampled position, 5]
    assert all(token in row for token, row in zip(sequence.tokens, top, strict=True))
    sampled = np.array([list(row).index(token) for token, row in zip(sequence.tokens, top, strict=True)])
    inputs = (prompt_tokens + list(sequence.tokens))[:-1]
    offset = len(prompt_tokens) - 1
    targets = [[0] * offset + list(column) for column in top.T]  # the top 5 at each sampled position
    scaled = trainer_scores(training_client, inputs, targets)[offset:] / TEMPERATURE
    expected = scaled[np.arange(len(sampled)), sampled] - np.logaddexp.reduce(scaled, axis=1)
    assert np.allclose(expected, sequence.logprobs, atol=2e-3), (expected, sequence.logprobs)
    # The sampler's top-5 logprobs are a whole distribution: the rest of the vocabulary has none.
    assert np.allclose(np.exp(sequence.topk_logprobs_np.logprobs).sum(axis=1), 1, atol=1e-3)


def test_the_replica_records_that_its_model_takes_a_lora_on_lm_head(tinker_stack, tiny, trained):
    """The SDK's default client (train_unembed) trained and sampled the tiny Llama above; its
    replica's record says its vLLM class takes a LoRA on lm_head (Qwen2, Mistral and Gemma 3 would
    be refused at create_model: tests/gateway/test_tinker_lora_targets.py)."""
    async def records(nc) -> list[DeploymentInfo]:
        kv = await nc.jetstream().key_value(subjects.MODELS_BUCKET)
        entries = [await kv.get(key) for key in await kv.keys()]
        return [DeploymentInfo.model_validate_json(entry.value or b"") for entry in entries]

    folder = str(Path(tiny).resolve())
    infos = [i for i in BusView(tinker_stack.nats_url, "lm-head-test").ask(records) if i.model_path == folder]
    assert [(i.architecture, i.lora_lm_head) for i in infos] == [("LlamaForCausalLM", True)], infos


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
