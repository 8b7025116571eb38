"""``compute_logprobs`` on a trained LoRA sampler (the SDK's defaults: the unembedding is trained
too), several at once beside plain and top-k samples, through the unmodified SDK on the shared
Tinker stack: the logprobs are the trainer's, and the replica serves on.

Before the fix in services/inference's ``lora_logits_vllm`` this killed vLLM's engine (issue 24:
``einsum(): subscript b has size 11 ... previously seen size 35`` in the replica's log, the replica
exited, and the futures never finished); the engine-level test is in
tests/inference/test_vllm_tokenformer.py.
"""

from __future__ import annotations

import numpy as np
from tinker import types

WAIT_S = 120  # a dead engine shows as a timeout here, not as a hung suite
TEXTS = ["English: banana split\nPig Latin: anana-bay plit-say",
         "The quick brown fox jumps over the lazy dog again and again",
         "1 2 3 4 5 6 7 8 9 10 11 12"]


def test_compute_logprobs_on_a_lora_beside_samples_agree_with_the_trainer(service, tiny):
    training_client = service.create_lora_training_client(base_model=tiny, rank=8)
    tokenizer = training_client.get_tokenizer()
    data = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
    for _ in range(3):  # a few steps, so the adapter (lm_head included) is not the base model
        training_client.forward_backward(data, "cross_entropy").result(WAIT_S)
        training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result(WAIT_S)
    sampling_client = training_client.save_weights_and_get_sampling_client(name="compute-logprobs")
    forward = training_client.forward(data, "cross_entropy").result(WAIT_S)

    # All sent before any is awaited, so the replica batches prompt-logprob and plain requests.
    prompts = [types.ModelInput.from_ints(tokenizer.encode(t)) for t in TEXTS]
    scored = [sampling_client.compute_logprobs(prompt) for prompt in prompts]
    hello = types.ModelInput.from_ints(tokenizer.encode("Hello"))
    plain = [sampling_client.sample(prompt=hello, num_samples=2,
                                    sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0))
             for _ in range(3)]
    topk = [sampling_client.sample(prompt=prompt, num_samples=1, include_prompt_logprobs=True,
                                   topk_prompt_logprobs=5, sampling_params=types.SamplingParams(max_tokens=1))
            for prompt in prompts]
    for future, out in zip(scored, forward.loss_fn_outputs, strict=True):
        got = future.result(WAIT_S)
        assert got[0] is None
        assert np.allclose(got[1:], out["logprobs"].tolist(), atol=1e-3)
    for future in plain:
        assert len(future.result(WAIT_S).sequences) == 2
    for future, text in zip(topk, TEXTS, strict=True):
        rows = future.result(WAIT_S).topk_prompt_logprobs
        assert rows is not None and len(rows) == len(tokenizer.encode(text))
        assert all(len(row) == 5 for row in rows[1:])

    # Serving goes on.
    after = sampling_client.sample(prompt=types.ModelInput.from_ints(tokenizer.encode("Hi")), num_samples=1,
                                   sampling_params=types.SamplingParams(max_tokens=4)).result(WAIT_S)
    assert len(after.sequences[0].tokens) == 4
