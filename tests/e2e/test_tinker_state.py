"""Saved state through the unmodified tinker SDK: save_state and the three ways back (load_state,
load_state_with_optimizer, a new client from state), named sampler saves pinned while training
goes on, the checkpoint and training-run routes, the SDK's parallel forward_backward chunks, and
the session events a follower sees.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.tinker_schemas import Payload, StepCall
from loopline.common.runtime import bus
from loopline.common.runtime.tinker_store import TinkerStore
from support.session_events import session_events

PAIRS = [("Say hi.", " Hi there!"), ("One plus one?", " Two."), ("Colour of sky?", " Blue.")]


def data_of(tokenizer) -> list[types.Datum]:
    data = []
    for prompt, answer in PAIRS:
        p, a = tokenizer.encode(prompt), tokenizer.encode(answer, add_special_tokens=False)
        tokens, weights = p + a, [0.0] * len(p) + [1.0] * len(a)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]}))
    return data


def train(client, data, steps: int, lr: float = 1e-2) -> None:
    for _ in range(steps):
        fwd = client.forward_backward(data, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))
        fwd.result()
        opt.result()


def logprobs(client, data) -> np.ndarray:
    out = client.forward(data, "cross_entropy").result()
    return np.concatenate([o["logprobs"].tolist() for o in out.loss_fn_outputs])


@pytest.fixture(scope="module")
def client_and_data(service, tiny):
    client = service.create_lora_training_client(base_model=tiny, rank=8, seed=3).result()
    data = data_of(client.get_tokenizer())
    train(client, data, 5)
    return client, data


def test_state_comes_back_three_ways(service, client_and_data):
    client, data = client_and_data
    saved = client.save_state("after-5").result()
    assert saved.path.endswith("/weights/after-5")
    before = logprobs(client, data)
    train(client, data, 3)
    after_more = logprobs(client, data)
    assert not np.allclose(before, after_more, atol=1e-4)

    # The optimizer comes back too: the same next step from the saved state as from the original.
    clone = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert np.allclose(logprobs(clone, data), before, atol=1e-5)
    train(clone, data, 3)
    assert np.allclose(logprobs(clone, data), after_more, atol=1e-4)

    fresh_optimizer = service.create_training_client_from_state(saved.path).result()
    assert np.allclose(logprobs(fresh_optimizer, data), before, atol=1e-5)

    client.load_state(saved.path).result()
    assert np.allclose(logprobs(client, data), before, atol=1e-5)


def test_a_named_sampler_save_keeps_its_weights_while_training_goes_on(service, client_and_data):
    client, data = client_and_data
    tokenizer = client.get_tokenizer()
    first = client.save_weights_for_sampler("snap-a").result()
    sampler = service.create_sampling_client(model_path=first.path)
    prompt = types.ModelInput.from_ints(tokenizer.encode(PAIRS[0][0]))
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    answer = sampler.sample(prompt=prompt, sampling_params=params, num_samples=1).result().sequences[0]

    train(client, data, 4, lr=5e-2)  # moves the live weights far
    second = client.save_weights_for_sampler("snap-b").result()
    again = sampler.sample(prompt=prompt, sampling_params=params, num_samples=1).result().sequences[0]
    assert again.tokens == answer.tokens  # still exactly snap-a's weights
    assert np.allclose(again.logprobs, answer.logprobs, atol=1e-5)

    rest = service.create_rest_client()
    run = rest.get_training_run(client.model_id).result()
    assert run.lora_rank == 8 and run.last_sampler_checkpoint is not None
    listed = {c.checkpoint_id for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert {"sampler_weights/snap-a", "sampler_weights/snap-b"} <= listed
    info = rest.get_weights_info_by_tinker_path(second.path).result()
    assert info.is_lora and info.lora_rank == 8
    rest.delete_checkpoint(client.model_id, "sampler_weights/snap-a").result()
    listed = {c.checkpoint_id for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert "sampler_weights/snap-a" not in listed
    with pytest.raises(Exception, match=r"404|no sampler checkpoint"):
        service.create_sampling_client(model_path=first.path).sample(
            prompt=prompt, sampling_params=params, num_samples=1).result()


def test_parallel_chunks_give_the_one_pass_result(service, tiny, client_and_data):
    """Over 1024 datums the SDK sends chunks in parallel (the first one last); the worker runs them
    in seq_id order, and the combined loss is the single pass's."""
    client, data = client_and_data
    many = (data * 400)[:1100]
    combined = client.forward(many, "cross_entropy").result()
    assert len(combined.loss_fn_outputs) == 1100
    one = client.forward(data, "cross_entropy").result()
    per_datum = [-float(np.dot(o["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist()))
                 for o, d in zip(one.loss_fn_outputs, data, strict=True)]
    expected = sum(per_datum[i % len(data)] for i in range(1100))
    assert combined.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)


def test_sessions_and_runs_are_listed(service, client_and_data):
    client, _ = client_and_data
    rest = service.create_rest_client()
    runs = rest.list_training_runs(limit=100).result().training_runs
    assert client.model_id in {r.training_run_id for r in runs}
    sessions = rest.list_sessions(limit=100).result().sessions
    session_id = client.model_id.split(":")[0]
    assert session_id in sessions
    assert client.model_id in rest.get_session(session_id).result().training_run_ids
    models = service.get_server_capabilities().supported_models
    assert any(m.trainable for m in models)


def test_session_events_carry_steps_and_saves(tinker_stack, client_and_data):
    client, _ = client_and_data

    mine = session_events(tinker_stack.nats_url, client.model_id)
    kinds = {e.kind for e in mine}
    assert {"created", "step", "saved"} <= kinds, kinds
    steps = [e for e in mine if e.kind == "step"]
    assert steps[0].step == 1 and steps[0].loss is not None and steps[0].loss > 0


def test_calls_run_in_seq_id_order_whatever_order_they_arrive_in(service, tiny, tinker_stack):
    """Published straight onto the worker's subject in reverse order (3, 2, 1), a model's calls
    still run 1, 2, 3: the forward_backward before the optim_step that needs its gradients."""
    client = service.create_lora_training_client(base_model=tiny, rank=4).result()
    data = data_of(client.get_tokenizer())
    fwd = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=client.model_id, seq_id=1)
    proto = forward_backward_request_to_proto(fwd).SerializeToString()
    adam = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=1e-2), model_id=client.model_id,
                                  seq_id=2)
    save = types.SaveWeightsRequest(model_id=client.model_id, path="ordered", seq_id=3)
    model_id = client.model_id
    calls = [
        StepCall(request_id=tinker_names.request_id(model_id, 3, "save_weights"), model_id=model_id,
                 seq_id=3, kind="save_weights", body=save.model_dump_json()),
        StepCall(request_id=tinker_names.request_id(model_id, 2, "optim_step"), model_id=model_id,
                 seq_id=2, kind="optim_step", body=adam.model_dump_json(exclude_none=True, by_alias=True)),
        StepCall(request_id=tinker_names.request_id(model_id, 1, "forward_backward"), model_id=model_id,
                 seq_id=1, kind="forward_backward", proto=Payload.inline(proto)),
    ]

    async def run():
        nc = await bus.connect(tinker_stack.nats_url, "test-tinker-order")
        try:
            store = TinkerStore(nc.jetstream(), nc.max_payload)
            await store.start()
            model = await store.model(client.model_id)
            assert model is not None
            for call in calls:
                await bus.publish_durable(nc.jetstream(), subjects.tinker_calls(model.worker_id),
                                          call.model_dump_json().encode(), msg_id=call.request_id)
                await asyncio.sleep(0.2)  # each arrives on its own, out of turn
            results = []
            for call in reversed(calls):
                for _ in range(300):
                    found = await store.result(call.request_id)
                    if found is not None:
                        break
                    await asyncio.sleep(0.1)
                assert found is not None and found.ok, (call.kind, found)
                results.append(found)
            return results
        finally:
            await nc.close()

    fwd_done, optim_done, save_done = asyncio.run(run())
    assert fwd_done.finished_at < optim_done.finished_at < save_done.finished_at
    assert optim_done.payload is not None
    metrics = json.loads(optim_done.payload.inline_bytes())["metrics"]
    assert metrics["grad_norm:mean"] > 0  # the step had the forward_backward's gradients


def test_a_client_side_custom_loss_trains(service, tiny):
    """forward_backward_custom: the SDK takes logprobs from a forward pass, computes the loss and
    its gradient itself, and sends them back as cross-entropy weights (negative ones included)."""
    import torch

    client = service.create_lora_training_client(base_model=tiny, rank=4, seed=5).result()
    data = data_of(client.get_tokenizer())

    def mean_nll(batch, logprobs_list):
        loss = -torch.stack([lp.mean() for lp in logprobs_list]).mean()
        return loss, {"mean_nll": float(loss.detach())}

    first = client.forward_backward_custom(data, mean_nll).result()
    client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    for _ in range(5):
        client.forward_backward_custom(data, mean_nll).result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    last = client.forward_backward_custom(data, mean_nll).result()
    assert last.metrics["mean_nll"] < first.metrics["mean_nll"], (first.metrics, last.metrics)
