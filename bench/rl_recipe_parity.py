"""The math_rl recipe's own training calls on a Loopline server against the same updates in one
process, step by step (issue 24: the recipe's loop learned less than bench/rl_in_process.py's).

    .venv-cookbook/bin/python bench/rl_recipe_parity.py http://127.0.0.1:8000 [--loss stable_reinforce]

bench/rl_parity.py showed the trainer computes what one process computes for awaited or pipelined
importance-sampling steps on one batch. This goes through what the recipe's loop adds: its
``train_step`` (pipelined, the datums' provenance spans sent, ``mask`` dropped), samplers from
unnamed saves (``save_checkpoint_and_get_sampling_client``) and from periodic named saves through
a CheckpointManager, stability records when the loss is stable_reinforce, fresh rollouts from the
server's sampler every step, and steps whose advantages are all zero (most of the recipe's early
steps on SmolLM2), after which AdamW's momentum still moves the weights. Both sides start from the
same LoRA (seed 1). Each step prints how far apart three things are, in nats of a datum's summed
response logprob: the sampler's logprobs and the in-process model before the step, the trainer's
(``forward_backward``'s) and the in-process model before the step, and both after the step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import sysconfig
import tempfile

sys.path.insert(0, sysconfig.get_paths()["purelib"])  # the SDK, not bench/tinker.py

import rl_in_process as ip
import tinker
import torch
from tinker import types
from tinker_cookbook.checkpoint_utils import CheckpointManager
from tinker_cookbook.completers import TinkerTokenCompleter
from tinker_cookbook.rl.train import save_checkpoint_and_get_sampling_client, train_step
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

LR = 3e-4
# What each step trains on: "signal" forces advantages of +1 / -1/3 on the response tokens so that
# every datum moves the weights; "zero" sends the rollouts with advantage 0 everywhere (a batch whose
# groups all had one reward). With save_every=3, steps 3 and 6 sample from periodic named saves.
PLAN = ("signal", "zero", "zero", "signal", "zero", "signal", "signal", "zero")


def with_advantages(datum: types.Datum, index: int, kind: str) -> types.Datum:
    mask = datum.loss_fn_inputs["mask"].to_torch().float()
    weight = 0.0 if kind == "zero" else (1.0 if index % 4 == 0 else -1 / 3)
    inputs = {**datum.loss_fn_inputs, "advantages": types.TensorData.from_torch(mask * weight)}
    return dataclasses.replace(datum, loss_fn_inputs=inputs)  # provenance spans kept


def learner(model: nn.Module, data: list[types.Datum], loss: str) -> tuple[Tensor, list[Tensor]]:
    """The summed loss the server's worker computes (importance_sampling, or stable_reinforce on the
    response tokens with its capped, gradient-free weight) and the learner's logprobs per datum."""
    if loss != "stable_reinforce":
        return ip.importance_sampling_loss(model, data)
    batch = ip.Batch(model, data)
    weight = torch.exp(batch.lp - batch.inputs("logprobs")).clamp(max=2.0).detach()
    per_token = -batch.inputs("mask") * weight * batch.inputs("advantages") * batch.lp
    return batch.summed(per_token), batch.per_datum()


def response_sums(logprobs: list[Tensor], data: list[types.Datum]) -> list[float]:
    return [float(lp[d.loss_fn_inputs["mask"].to_torch() != 0].sum())
            for lp, d in zip(logprobs, data, strict=True)]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    params = ip.add_lora(model, 32, 1)
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    dataset = await ip.ArithmeticDatasetBuilder(
        batch_size=2, model_name_for_tokenizer=args.model, renderer_name="role_colon", n_batches=100,
        include_fewshot=True, group_size=4)()
    dataset = dataset[0]
    service = tinker.ServiceClient(base_url=args.url, api_key="tml-loopline")
    client = await service.create_lora_training_client_async(base_model=args.model, rank=32, seed=1)
    record = args.loss == "stable_reinforce"
    manager = CheckpointManager(client, service, tempfile.mkdtemp(prefix="rl-recipe-parity-"), save_every=3)
    sampler, _ = await save_checkpoint_and_get_sampling_client(client, manager, 0, 0,
                                                               record_stability_info=record)
    worst = {"sampler": 0.0, "trainer": 0.0, "after": 0.0}
    for step, kind in enumerate(PLAN):
        completer = TinkerTokenCompleter(sampler, max_tokens=16, temperature=1.0)
        builders = dataset.get_batch(step)
        groups = list(await asyncio.gather(*(ip.do_group_rollout(b, completer) for b in builders)))
        data, _ = ip.assemble_training_data(groups, ip.compute_advantages(groups))
        assert all(d.loss_fn_input_spans is not None for d in data), "the server's samples carry ids"
        data = [with_advantages(d, i, kind) for i, d in enumerate(data)]
        sampled = response_sums([d.loss_fn_inputs["logprobs"].to_torch() for d in data], data)
        loss, before = learner(model, data, args.loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        trained = await train_step(data, client, LR, 1, args.loss)  # the recipe's own call
        with torch.no_grad():
            here = response_sums(learner(model, data, args.loss)[1], data)
        unmasked = [dataclasses.replace(d, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                                           if k != "mask"}) for d in data]
        served = await client.forward(unmasked, "importance_sampling")
        there = response_sums([torch.tensor(o["logprobs"].to_numpy()) for o in served.loss_fn_outputs], data)
        figures = {"sampler": gap(sampled, response_sums(before, data)),
                   "trainer": gap(response_sums(trained, data), response_sums(before, data)),
                   "after": gap(here, there)}
        worst = {k: max(worst[k], v) for k, v in figures.items()}
        print(f"step {step} ({kind:6}): sampler vs in-process {figures['sampler']:.4f}, trainer vs "
              f"in-process {figures['trainer']:.4f}, after the step {figures['after']:.4f} nats", flush=True)
        sampler, _ = await save_checkpoint_and_get_sampling_client(client, manager, step + 1,
                                                                   record_stability_info=record)
    print(f"{args.loss}, {len(PLAN)} steps: largest differences " + json.dumps(worst))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--model", default=ip.MODEL, help="the served base model's folder")
    parser.add_argument("--loss", default="importance_sampling",
                        choices=("importance_sampling", "stable_reinforce"))
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
