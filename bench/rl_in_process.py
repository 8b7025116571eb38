"""The cookbook's math_rl recipe (arithmetic env) computed in one process, no server: the reference
that the platform's RL curve (docs/tinker/math_rl.metrics.jsonl) is compared with (issue 24).

    .venv-cookbook/bin/python bench/rl_in_process.py --seed 0 --iterations 24 --out /tmp/inproc.jsonl
    .venv-cookbook/bin/python bench/rl_in_process.py --seed 0 --server http://127.0.0.1:8000 ...

Run with the cookbook's venv (not the platform's): problems, prompts, rewards, rollouts, metrics,
advantages and datums are the cookbook's own (ArithmeticDatasetBuilder, do_group_rollout,
compute_trajectory_metrics, compute_advantages, assemble_training_data). What the server would do
is done here: sampling (a TokenCompleter over a local transformers model), LoRA as the Tinker worker
sets it up (rank r, alpha 32, q/k/v/o/gate/up/down and lm_head, A Kaiming-uniform, B zero), the
importance_sampling loss summed over every token of every datum, and one AdamW step per iteration
with the AdamParams the cookbook's rl/train.py sends. Float32 on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

# bench/tinker.py (a platform benchmark) would shadow the SDK: the venv's packages come first.
sys.path.insert(0, sysconfig.get_paths()["purelib"])

import tinker
import torch
from tinker_cookbook.completers import StopCondition, TinkerTokenCompleter, TokenCompleter, TokensWithLogprobs
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl.data_processing import (
    assemble_training_data,
    compute_advantages,
    remove_constant_reward_groups,
)
from tinker_cookbook.rl.metric_util import compute_trajectory_metrics
from tinker_cookbook.rl.metrics import compute_kl_sample_train
from tinker_cookbook.rl.rollouts import do_group_rollout
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

MODEL = str(Path(__file__).resolve().parent.parent / ".loopline/models/SmolLM2-135M-Instruct")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
LORA_ALPHA = 32.0  # the worker's constant: Tinker's LoraConfig carries only the rank


class LoraLinear(nn.Module):
    """y = W x + (alpha / r) B A x, W frozen; B starts at zero so step 0 is the base model."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator):
        super().__init__()
        self.base = base  # lm_head's weight stays tied to the embeddings
        a = torch.empty(rank, base.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = LORA_ALPHA / rank

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scale * ((x @ self.lora_a.T) @ self.lora_b.T)


def add_lora(model: nn.Module, rank: int, seed: int) -> list[nn.Parameter]:
    """Wrap the targets in sorted path order, A drawn from one seeded generator, as the worker does."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    paths = sorted(p for p, m in model.named_modules()
                   if p.rsplit(".", 1)[-1] in TARGETS and isinstance(m, nn.Linear))
    params: list[nn.Parameter] = []
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        wrapper = LoraLinear(getattr(owner, leaf), rank, generator)
        setattr(owner, leaf, wrapper)
        params += [wrapper.lora_a, wrapper.lora_b]
    return params


class BatchSampler(TokenCompleter):
    """The cookbook's rollouts ask for one sample per env; this holds the calls until all `expected`
    of an iteration have arrived and samples them in one batch (32 separate generate loops would
    cost ~10x on two cores). Tinker-like: plain temperature sampling over the full vocabulary (no
    top-k/top-p), the response keeps the stop sequence's tokens or the EOS that ended it."""

    def __init__(self, model: nn.Module, tokenizer, expected: int, max_tokens: int,
                 temperature: float):
        self.model, self.tokenizer, self.expected = model, tokenizer, expected
        self.max_tokens, self.temperature = max_tokens, temperature
        self.pending: list[tuple[list[int], StopCondition, asyncio.Future[TokensWithLogprobs]]] = []

    async def __call__(self, model_input: tinker.ModelInput, stop: StopCondition, *,
                       max_tokens: int | None = None) -> TokensWithLogprobs:
        future: asyncio.Future[TokensWithLogprobs] = asyncio.get_running_loop().create_future()
        self.pending.append((model_input.to_ints(), stop, future))
        if len(self.pending) == self.expected:
            batch, self.pending = self.pending, []
            for (_, _, fut), result in zip(batch, self.sample([(p, s) for p, s, _ in batch]),
                                           strict=True):
                fut.set_result(result)
        return await future

    @torch.no_grad()
    def sample(self, requests: list[tuple[list[int], StopCondition]]) -> list[TokensWithLogprobs]:
        # A group's samples share one prompt: prefill each distinct prompt once, then copy its cache.
        distinct = list(dict.fromkeys(tuple(p) for p, _ in requests))
        rows = torch.tensor([distinct.index(tuple(p)) for p, _ in requests])
        n, width = len(requests), max(len(p) for p in distinct)
        pad = self.tokenizer.pad_token_id or 0
        # Left padding so every row's next token is at the last column.
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in distinct])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in distinct])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        out.past_key_values.reorder_cache(rows)
        logits, mask, positions = out.logits[rows, -1], mask[rows], positions[rows]
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        stopped = [False] * n
        for _ in range(self.max_tokens):
            logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1)
            for i, (_, stop) in enumerate(requests):
                if stopped[i]:
                    continue
                tok = int(nxt[i, 0])
                tokens[i].append(tok)
                logprobs[i].append(float(logp[i, tok]))
                text = self.tokenizer.decode(tokens[i])
                stopped[i] = (tok == self.tokenizer.eos_token_id or tok in stop
                              or any(isinstance(s, str) and s in text for s in stop))
            if all(stopped):
                break
            mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype)], dim=-1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=nxt, attention_mask=mask, position_ids=positions,
                             past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[:, -1]
        return [TokensWithLogprobs(tokens=t, maybe_logprobs=lp, stop_reason="stop" if s else "length")
                for t, lp, s in zip(tokens, logprobs, stopped, strict=True)]


class Batch:
    """Datums padded to one batch and run through the model: each target token's logprob ``lp``,
    which positions are real, and ``inputs(key)``, a loss input padded to the batch."""

    def __init__(self, model: nn.Module, data: list[tinker.Datum]):
        self.data, self.lengths = data, [d.model_input.length for d in data]
        self.width = max(self.lengths)
        ids = torch.tensor([d.model_input.to_ints() + [0] * (self.width - n)
                            for d, n in zip(data, self.lengths, strict=True)])
        self.real = torch.tensor([[1] * n + [0] * (self.width - n) for n in self.lengths]).bool()
        logits = model(input_ids=ids, attention_mask=self.real.long()).logits.float()
        targets = self.inputs("target_tokens").long()
        # log_softmax at the targets, without a second [batch, tokens, vocab] tensor.
        self.lp = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")

    def inputs(self, key: str) -> Tensor:
        rows = [d.loss_fn_inputs[key].to_torch().float() for d in self.data]
        return torch.stack([torch.nn.functional.pad(r, (0, self.width - len(r))) for r in rows])

    def summed(self, per_token: Tensor) -> Tensor:
        return torch.where(self.real, per_token, 0.0).sum()

    def per_datum(self) -> list[Tensor]:
        """The learner's logprobs, one tensor per datum, without a graph."""
        return [self.lp[i, :n].detach() for i, n in enumerate(self.lengths)]


def importance_sampling_loss(model: nn.Module, data: list[tinker.Datum]) -> tuple[Tensor, list[Tensor]]:
    """Tinker's importance_sampling, -sum_t exp(lp - lp_sampler) * A, summed over every datum (no
    mean); prompt positions carry A = 0 and add nothing. Also the learner's logprobs per datum."""
    batch = Batch(model, data)
    per_token = -torch.exp(batch.lp - batch.inputs("logprobs")) * batch.inputs("advantages")
    return batch.summed(per_token), batch.per_datum()


class InProcess:
    """The server's part of the loop done here: sampling (``BatchSampler``), the LoRA, the loss and
    AdamW, on a model of this process."""

    def __init__(self, args: argparse.Namespace, tokenizer):
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        self.params = add_lora(self.model, args.rank, args.seed)
        for param in self.params:
            param.grad = torch.zeros_like(param)
        self.args = args
        self.completer: TokenCompleter = BatchSampler(self.model, tokenizer, args.groups * args.group_size,
                                                      args.max_tokens, args.temperature)
        self.optimizer: torch.optim.Optimizer | None = None

    def before_sampling(self) -> None:
        self.model.eval()

    async def train(self, data: list[tinker.Datum], adam: tinker.AdamParams, step: int) -> dict[str, Any]:
        """The loss, backward and one AdamW step; loss, grad_norm, kl and the seconds it took."""
        start = time.monotonic()
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=adam.learning_rate,
                                               betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                               weight_decay=adam.weight_decay)
        self.model.train()
        # A datum whose advantages are all zero (its group's rewards were equal) adds exactly zero
        # to the loss and gradient: only the others go through backward. The rest go forward
        # without a graph, for the learner's logprobs of every datum that the server returns and
        # the recipe's KL metric is computed from.
        trained = [d for d in data if d.loss_fn_inputs["advantages"].to_torch().any()]
        rest = [d for d in data if not d.loss_fn_inputs["advantages"].to_torch().any()]
        loss, learner = 0.0, []
        if trained:
            summed, learner = importance_sampling_loss(self.model, trained)
            summed.backward()
            loss = summed.item()
        with torch.no_grad():  # in batches of 8: one of 32 datums' logits is ~1 GB
            for i in range(0, len(rest), 8):
                learner += Batch(self.model, rest[i:i + 8]).per_datum()
        kl = compute_kl_sample_train(trained + rest, learner)["optim/kl_sample_train_v1"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, math.inf))
        # Zero gradients (not None) still take an AdamW step, its momentum moving the weights,
        # as the platform's optim_step does after a forward_backward whose advantages were all 0.
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return {"loss": loss, "grad_norm": grad_norm, "kl_sample_train_v1": kl,
                "trained_datums": len(trained), "train_s": time.monotonic() - start, "save_s": 0.0}


class Server:
    """``--server URL``: the same loop, with a Loopline server sampling and training (through the
    SDK) from a LoRA drawn from the same seed, so only the executor differs from the in-process run.
    (The recipe's own loop, rl/train.py, also pipelines its calls and saves named checkpoints.)"""

    def __init__(self, client: tinker.TrainingClient, args: argparse.Namespace):
        self.client, self.args = client, args
        self.completer: TokenCompleter | None = None

    @classmethod
    async def start(cls, args: argparse.Namespace) -> Server:
        service = tinker.ServiceClient(base_url=args.server, api_key="tml-loopline")
        client = await service.create_lora_training_client_async(base_model=args.model, rank=args.rank,
                                                                 seed=args.seed)
        server = cls(client, args)
        await server.new_sampler(0)
        return server

    def before_sampling(self) -> None:
        pass

    async def new_sampler(self, step: int) -> None:
        sampler = await self.client.save_weights_and_get_sampling_client(f"rl-{step}")
        self.completer = TinkerTokenCompleter(sampler, max_tokens=self.args.max_tokens,
                                              temperature=self.args.temperature)

    async def train(self, data: list[tinker.Datum], adam: tinker.AdamParams, step: int) -> dict[str, Any]:
        """forward_backward then optim_step, each awaited, then a sampler of the new weights; loss,
        grad_norm, kl and the seconds training and the save took."""
        start = time.monotonic()
        # The recipe drops "mask" before sending (rl/train.py's _remove_mask): it is not a loss input.
        sent = [tinker.Datum(model_input=d.model_input, loss_fn_inputs={
            k: v for k, v in d.loss_fn_inputs.items() if k != "mask"}) for d in data]
        passed = await (await self.client.forward_backward_async(sent, "importance_sampling"))
        stepped = await (await self.client.optim_step_async(adam))
        learner = [out["logprobs"].to_torch() for out in passed.loss_fn_outputs]
        kl = compute_kl_sample_train(data, learner)["optim/kl_sample_train_v1"]
        trained = time.monotonic()
        await self.new_sampler(step + 1)
        return {"loss": passed.metrics["loss:sum"], "grad_norm": stepped.metrics["grad_norm:mean"],
                "kl_sample_train_v1": kl, "trained_datums": len(data), "train_s": trained - start,
                "save_s": time.monotonic() - trained}


Executor = InProcess | Server


async def load_dataset(args: argparse.Namespace):
    dataset, _ = await ArithmeticDatasetBuilder(
        batch_size=args.groups, model_name_for_tokenizer=args.model, renderer_name="role_colon",
        n_batches=100, include_fewshot=True, group_size=args.group_size)()
    return dataset


def adam_params(args: argparse.Namespace) -> tinker.AdamParams:
    """What the cookbook's rl/train.py sends each step; the other fields are the SDK's defaults."""
    adam = tinker.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.95, eps=1e-8)
    assert adam.grad_clip_norm == 0.0  # no clipping, as the worker does for 0
    return adam


async def iteration(executor: Executor, dataset, step: int, adam: tinker.AdamParams,
                    args: argparse.Namespace) -> dict[str, Any]:
    """One iteration of the recipe on ``executor``: its row, with where its seconds went (sampling,
    training, the save of the new weights to a sampler, and the rest: the cookbook's own work)."""
    start = time.monotonic()
    builders = dataset.get_batch(step)
    executor.before_sampling()
    completer = executor.completer
    assert completer is not None
    groups = list(await asyncio.gather(*(do_group_rollout(b, completer) for b in builders)))
    sampled = time.monotonic()
    metrics = compute_trajectory_metrics(groups, [b.logging_tags() for b in builders])
    # The recipe's Config leaves remove_constant_reward_groups False.
    kept = remove_constant_reward_groups(groups) if args.remove_constant_reward_groups else groups
    data, _ = assemble_training_data(kept, compute_advantages(kept))
    trained = await executor.train(data, adam, step)
    # What the platform's optim/entropy measures (-mean sampler logprob of all sampled tokens).
    sampled_lp = [lp for g in groups for t in g.trajectories_G for lp in t.transitions[0].ac.logprobs]
    seconds = time.monotonic() - start
    return {"step": step, **{f"env/all/{k}": metrics[f"env/all/{k}"] for k in (
        "reward/total", "correct", "format", "by_group/frac_mixed", "ac_tokens_per_turn")},
        "loss": trained["loss"], "grad_norm": trained["grad_norm"], "datums": len(data),
        "trained_datums": trained["trained_datums"], "kl_sample_train_v1": trained["kl_sample_train_v1"],
        "sampled_entropy": -sum(sampled_lp) / len(sampled_lp), "seconds": round(seconds, 2),
        "sampling_s": round(sampled - start, 2), "train_s": round(trained["train_s"], 2),
        "save_s": round(trained["save_s"], 2),
        "other_s": round(seconds - (sampled - start) - trained["train_s"] - trained["save_s"], 2)}


def append_line(path: str, line: str) -> None:
    with open(path, "a") as f:  # reopened per row: a killed run keeps the rows it finished
        f.write(line + "\n")


async def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    dataset = await load_dataset(args)
    adam = adam_params(args)
    executor: Executor = (await Server.start(args) if args.server
                          else InProcess(args, dataset.renderer.tokenizer))
    rewards: list[float] = []
    for step in range(args.iterations):
        row = await iteration(executor, dataset, step, adam, args)
        rewards.append(row["env/all/reward/total"])
        append_line(args.out, json.dumps(row))
        print(json.dumps(row), flush=True)
    third = len(rewards) // 3
    if third:
        first, last = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
        print(f"mean reward: first third {first:+.3f}, last third {last:+.3f}, "
              f"difference {last - first:+.3f} ({len(rewards)} iterations)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe's settings, shared with bench/rl_loop.py."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--groups", type=int, default=8, help="groups_per_batch (problems)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--remove-constant-reward-groups", action="store_true",
                        help="drop groups whose rewards are all equal (zero advantage anyway)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--out", default="/tmp/rl_in_process.jsonl")
    parser.add_argument("--server", help="sample and train through this Loopline server instead "
                        "(its URL; SmolLM2 served under --model's folder)")
    args = parser.parse_args()
    Path(args.out).write_text("")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
