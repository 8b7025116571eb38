"""One RL batch, the same updates on a Loopline server and in one process: do the trainer and the
served adapter compute what bench/rl_in_process.py computes? (issue 24: the platform's math_rl runs
learned less in 24 iterations than the in-process reference; this rules the computation in or out.)

    .venv-cookbook/bin/python bench/rl_parity.py http://127.0.0.1:8000 [--steps 6]

Run with the cookbook's venv against a stack serving SmolLM2 (docs/tinker/run_cookbook.sh starts one
the same way). Both sides start from the same LoRA (seed 1: the worker draws A from a seeded
generator in module order, as rl_in_process.add_lora does), train on one batch of 8 rollouts of the
cookbook's arithmetic task with importance_sampling and the cookbook's AdamParams, and after each
step print each datum's summed logprob of its response. Then the server's adapter is sampled and
scored through vLLM and compared with the in-process model, and both samplers' rollouts are counted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import sysconfig

sys.path.insert(0, sysconfig.get_paths()["purelib"])  # the SDK, not bench/tinker.py

import rl_in_process as ip
import tinker
import torch
from tinker import types
from tinker_cookbook.completers import TinkerTokenCompleter, TokenCompleter
from transformers import AutoModelForCausalLM, AutoTokenizer

ADAM = types.AdamParams(learning_rate=3e-4, beta1=0.9, beta2=0.95, eps=1e-8)


async def arithmetic(groups: int, group_size: int):
    dataset, _ = await ip.ArithmeticDatasetBuilder(
        batch_size=groups, model_name_for_tokenizer=ip.MODEL, renderer_name="role_colon",
        n_batches=100, include_fewshot=True, group_size=group_size)()
    return dataset


async def batch(completer: TokenCompleter) -> list[types.Datum]:
    """8 rollouts (2 problems x 4), each with advantage +1 (first of its group) or -1/3 on its
    response tokens, whatever the rewards were: every datum moves the weights."""
    builders = (await arithmetic(2, 4)).get_batch(1)
    groups = list(await asyncio.gather(*(ip.do_group_rollout(b, completer) for b in builders)))
    data, _ = ip.assemble_training_data(groups, ip.compute_advantages(groups))
    out = []
    for i, d in enumerate(data):
        response = (d.loss_fn_inputs["logprobs"].to_torch() != 0).float()
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": d.loss_fn_inputs["logprobs"],
            "advantages": types.TensorData.from_torch(response * (1.0 if i % 4 == 0 else -1 / 3))}))
    return out


def sums(logprobs: list[torch.Tensor], data: list[types.Datum]) -> list[float]:
    """Each datum's summed logprob over its response tokens."""
    return [float(lp[d.loss_fn_inputs["logprobs"].to_torch() != 0].sum())
            for lp, d in zip(logprobs, data, strict=True)]


async def rollout_stats(completer: TokenCompleter, label: str) -> None:
    dataset = await arithmetic(8, 8)
    lengths, eos = [], 0
    for index in (10, 11, 12):
        groups = await asyncio.gather(*(ip.do_group_rollout(b, completer) for b in dataset.get_batch(index)))
        for trajectory in (t for g in groups for t in g.trajectories_G):
            tokens = trajectory.transitions[0].ac.tokens
            lengths.append(len(tokens))
            eos += tokens[-1] == 2
    print(f"{label}: {len(lengths)} rollouts, mean length {statistics.mean(lengths):.2f}, "
          f"ended with EOS {eos / len(lengths):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pipelined", action="store_true",
                        help="send each step's optim_step before forward_backward has answered")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(ip.MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ip.MODEL, dtype=torch.float32)
    params = ip.add_lora(model, 32, 1)
    data = asyncio.run(batch(ip.BatchSampler(model, tokenizer, 8, 16, 1.0)))
    optimizer = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                                  eps=ADAM.eps, weight_decay=ADAM.weight_decay)
    service = tinker.ServiceClient(base_url=args.url, api_key="tml-loopline")
    client = service.create_lora_training_client(base_model=ip.MODEL, rank=32, seed=1).result()
    worst = 0.0
    for step in range(args.steps):
        loss, _ = ip.importance_sampling_loss(model, data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if args.pipelined:  # as the recipe's rl/train.py: both sent before either answer is read
            passed, stepped = client.forward_backward(data, "importance_sampling"), client.optim_step(ADAM)
            passed.result(), stepped.result()
        else:
            client.forward_backward(data, "importance_sampling").result()
            client.optim_step(ADAM).result()
        with torch.no_grad():
            here = sums(ip.importance_sampling_loss(model, data)[1], data)
        served = client.forward(data, "importance_sampling").result()
        there = sums([torch.tensor(o["logprobs"].to_numpy()) for o in served.loss_fn_outputs], data)
        worst = max(worst, *(abs(a - b) for a, b in zip(here, there, strict=True)))
        print(f"step {step}: in-process {[round(x, 3) for x in here]}")
        print(f"        server     {[round(x, 3) for x in there]}")
    sampler = client.save_weights_and_get_sampling_client("parity").result()
    vllm = []
    for d in data:
        tokens = [*d.model_input.to_ints(), int(d.loss_fn_inputs["target_tokens"].to_torch()[-1])]
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
        vllm.append(torch.tensor([0.0 if x is None else x for x in scored]))
    served_sums = sums(vllm, data)
    worst_served = max(abs(a - b) for a, b in zip(here, served_sums, strict=True))
    print(f"trainer: largest difference of a summed response logprob, {args.steps} steps: {worst:.4f} nats")
    print(f"served adapter (vLLM) vs in-process after them: largest difference {worst_served:.4f} nats")
    served_completer = TinkerTokenCompleter(sampler, max_tokens=16, temperature=1.0)
    asyncio.run(rollout_stats(served_completer, "served sampler"))
    model.eval()
    asyncio.run(rollout_stats(ip.BatchSampler(model, tokenizer, 64, 16, 1.0), "in-process sampler"))
    assert math.isfinite(worst)


if __name__ == "__main__":
    main()
