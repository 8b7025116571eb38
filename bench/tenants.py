"""Several Tinker training clients stepping at once on one base model, against one client alone.

    .venv/bin/python bench/tenants.py [--model tiny] [--tenants 4] [--rounds 8] [--warmup 2] \
        [--batch 8] [--seq-len 128] [--rank 8] [--out bench/results/tenants.json]

One ``LocalStack`` (local launcher): ``--tenants`` training clients of the SDK on the same base model
(so one session worker), and one more client alone. A round is one train step (``forward_backward``
then ``optim_step``, both sent, then awaited) of the lone client, then one step of every tenant at
once, each on its own ``--batch`` rows of ``--seq-len`` random tokens (cross-entropy). It prints the
median step time of each, after ``--warmup`` rounds, and their ratio: N clients' step over one
client's (N if the worker ran them one after the other; the target is <= 2 for 4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from tinker_parts import ADAM, SEED, sdk_data, token_rows, with_stack  # noqa: E402  (bench/ on the path)

sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # bench/tinker.py is not the SDK

REPO = HERE.parent
TARGET = 2.0


async def step(client, data) -> float:
    from tinker import types as tt

    started = time.perf_counter()
    fb = client.forward_backward(data, "cross_entropy")  # both sent, then both awaited
    opt = client.optim_step(tt.AdamParams(**ADAM))
    await fb
    await opt
    return time.perf_counter() - started


async def rounds(service, stack, args, vocab: int) -> dict:
    import tinker

    # Each client with its own ServiceClient, as separate users' programs would be (one SDK
    # ServiceClient drives its clients' requests from one thread).
    services = [service] + [tinker.ServiceClient(base_url=stack.url, api_key="tml-bench")
                            for _ in range(args.tenants)]
    made = [s.create_lora_training_client(base_model=args.model_path, rank=args.rank, seed=SEED + i)
            for i, s in enumerate(services)]
    clients = list(await asyncio.gather(*made))
    alone, tenants = clients[0], clients[1:]
    data = [sdk_data(token_rows(vocab, args.batch, args.seq_len, SEED + i)) for i in range(len(clients))]
    out: dict[str, list[float]] = {"alone_s": [], "tenants_s": []}
    # Invariant: out holds the rounds after the warm-up among those done, each a lone step then
    # one step of every tenant at once.
    for i in range(args.warmup + args.rounds):
        one = await step(alone, data[0])
        started = time.perf_counter()
        await asyncio.gather(*(step(c, d) for c, d in zip(tenants, data[1:], strict=True)))
        many = time.perf_counter() - started
        print(f"  round {i + 1}: one client {one * 1000:.0f} ms, {args.tenants} at once "
              f"{many * 1000:.0f} ms ({many / one:.2f}x)", flush=True)
        if i >= args.warmup:
            out["alone_s"].append(one)
            out["tenants_s"].append(many)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/tenants.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TINKER_TELEMETRY"] = "0"
    from transformers import AutoConfig

    from loopline.ml.models.resolve import resolve_model

    models_dir = REPO / ".loopline/models"
    args.model_path = str(resolve_model(args.model, models_dir))
    vocab = AutoConfig.from_pretrained(args.model_path).vocab_size
    with tempfile.TemporaryDirectory(prefix="loopline-bench-tenants-") as state:
        figures = with_stack(Path(state), args.model_path,
                             lambda service, stack: rounds(service, stack, args, vocab), models_dir)
    one, many = statistics.median(figures["alone_s"]), statistics.median(figures["tenants_s"])
    ratio = many / one
    print(f"\none client's step: {one * 1000:.0f} ms (median of {args.rounds}); {args.tenants} clients' "
          f"steps at once: {many * 1000:.0f} ms; ratio {ratio:.2f}x (target <= {TARGET}x: "
          f"{'PASS' if ratio <= TARGET else 'MISS'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **figures,
                                    "ratio": ratio}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
