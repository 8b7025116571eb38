"""Async RL, stamped (issue 26, item 3): each sample request carries the version of the weights that
drew it, and each optimizer step reports how many steps behind the trainer its trained samples were,
in its session event and in the step's metrics (which the cookbook logs). Through the unmodified
tinker SDK on a whole stack; then the cookbook's own async mode (``max_steps_off_policy``).
"""

from __future__ import annotations

import math

from e2e.test_tinker_cookbook import recorded_checkpoints
from e2e.test_tinker_state import data_of, train
from tinker import types

from loopline.common.contracts import tinker_names
from support.cookbook import MATH_RL, math_rl_args, run_recipe
from support.session_events import session_events

PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0)


def rl_datum(prompt: list[int], sequence: types.SampledSequence, advantage: float) -> types.Datum:
    """The cookbook's RL datum for one sample (prompt + sample, shifted by one), with provenance."""
    sampled = list(sequence.tokens)
    tokens = prompt + sampled
    n = len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * n + list(sequence.logprobs or []),
                        "advantages": [0.0] * n + [advantage] * len(sampled)})
    inputs: list = [types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=len(prompt))]
    if len(sampled) > 1:
        inputs.append(types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(sampled) - 1))
    return datum.with_provenance(
        model_input=inputs,
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1, length=n),
                        types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(sampled))])


def test_each_step_reports_how_stale_its_samples_were(service, tinker_stack, tiny):
    client = service.create_lora_training_client(base_model=tiny, rank=4).result()
    tokenizer = client.get_tokenizer()
    prompt = tokenizer.encode("One plus one?")
    model_input = types.ModelInput.from_ints(prompt)

    at_0 = client.save_weights_and_get_sampling_client(name="staleness-0")
    old = at_0.sample(model_input, num_samples=2, sampling_params=PARAMS).result().sequences
    train(client, data_of(tokenizer), 2)  # steps 1 and 2, no samples in them
    at_2 = client.save_weights_and_get_sampling_client(name="staleness-2")
    new = at_2.sample(model_input, num_samples=3, sampling_params=PARAMS).result().sequences
    base = service.create_sampling_client(base_model=tiny).sample(
        model_input, num_samples=1, sampling_params=PARAMS).result().sequences

    data = [rl_datum(prompt, s, 1.0) for s in [*old, *new, *base]]
    client.forward_backward(data, "importance_sampling").result()
    metrics = client.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics
    # 2 samples 2 steps behind, 3 on-policy; the base model's is not this run's weights.
    assert metrics["staleness:max"] == 2.0 and math.isclose(metrics["staleness:mean"], 4 / 5), metrics

    steps = {e.step: e for e in session_events(tinker_stack.nats_url, client.model_id) if e.kind == "step"}
    assert set(steps) == {1, 2, 3}, steps
    assert steps[1].staleness is None and steps[2].staleness is None and steps[1].unstamped is None
    assert steps[3].staleness == {2: 2, 0: 3} and steps[3].unstamped == 1, steps[3]


def test_the_cookbooks_async_mode_runs_and_its_steps_report_staleness(tinker_stack, tiny, tmp_path):
    """math_rl with ``max_steps_off_policy=1``: sampling for the next step overlaps training of this
    one. Every trained sample comes from this run's weights at most one step behind, which the
    step's metrics (logged by the recipe) and session event both say."""
    log_path = tmp_path / "math_rl_async"
    steps = 4
    run = run_recipe(MATH_RL, math_rl_args(tinker_stack.url, tiny, log_path, max_steps=steps,
                                           max_steps_off_policy=1), timeout=300)
    assert run.returncode == 0, run.tail()
    trained = [row for row in run.metrics if "staleness:max" in row]
    assert len(trained) == steps, run.metrics
    for row in trained:
        assert 0 <= row["staleness:mean"] <= row["staleness:max"] <= 1, row

    model_id = tinker_names.parse_path(recorded_checkpoints(log_path)[-1]["state_path"]).model_id
    events = [e for e in session_events(tinker_stack.nats_url, model_id) if e.kind == "step"]
    assert len(events) == steps, events
    for event in events:  # 8 groups of 4 samples a step
        assert event.staleness is not None and sum(event.staleness.values()) == 8 * 4, event
        assert max(event.staleness) <= 1 and not event.unstamped, event
