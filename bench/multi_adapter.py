"""Many adapters in one stream: throughput with 8 different adapters mixed, against 1 adapter and
against the base model, in one run.

    python bench/multi_adapter.py [--model tiny] [--prompts 128] [--max-tokens 32] [--adapters 8] \
        [--repeats 3] [--out bench/results/multi_adapter.json]

One LocalStack (gateway, NATS, queue, checkpoint-watcher, one vLLM replica). ``--adapters`` jobs are
deployed the way training deploys them: a checkpoint written into each job's folder, announced by
the watcher, loaded by the replica. All are Tokenformer adapters (2 parameter tokens on every
``down_proj``, tests/support/forced_adapters.py), each forcing a different token, so every request
to an adapter generates exactly ``--max-tokens`` tokens and the three modes do the same work. The
same ``--prompts`` prompts (greedy, all in flight at once) are sent as

  (i)   the base model,
  (ii)  all to one adapter,
  (iii) round-robin over the ``--adapters`` adapters (one stream mixing them all),

in the order i, ii, iii, iii, ii, i, ... for ``--repeats`` rounds so each pair of modes sees about
the same load from other users; each mode's figure is its median. Tokens are the completion tokens
the responses report. Target: (iii)/(ii) >= 0.8 (PASS/MISS); (ii)/(i) is printed for information
(what serving through the LoRA path costs over the plain base model). vLLM mixes at most
``max_loras`` adapters in one batch: the replica passes ``LOOPLINE_MAX_ADAPTERS`` (default 8) as
``max_loras``, so 8 adapters fit one batch. It always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # support.forced_adapters: the same adapters the tests use

TARGET_MIXED_RATIO = 0.8
_WORDS = ("the a of to in on for with and or model token text data train step loss answer question "
          "user prompt reply small large fast slow time day city river mountain water fire").split()


def make_prompts(count: int) -> list[str]:
    # Deterministic and varied in length (5..20 words), so batches are not uniform.
    return [" ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(5 + i % 16))
            for i in range(count)]


async def deploy(stack, model: str, count: int) -> list[str]:
    import httpx

    from support.forced_adapters import ForcedAdapters, write_checkpoint, write_job_config

    forge = ForcedAdapters(model)
    tokens = forge.pick_tokens(count)
    jobs = []
    for token in tokens:
        job = uuid.uuid4().hex + uuid.uuid4().hex
        write_job_config(stack.jobs_dir, job, model)
        write_checkpoint(stack.jobs_dir, job, 1, forge.config, forge.tensors(token))
        jobs.append(job)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        for job in jobs:  # deployed = a replica loaded it: until then the gateway answers 404
            deadline = time.monotonic() + 60
            while (r := await http.post("/v1/completions", json={"model": job, "prompt": "hi",
                                                                 "max_tokens": 2})).status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job} not deployed: {r.status_code} {r.text[:200]}")
                await asyncio.sleep(0.05)
    return jobs


async def one_pass(url: str, models: list[str], prompts: list[str], max_tokens: int) -> dict:
    """Every prompt at once, prompt i to models[i % len(models)]; one connection per request."""
    import httpx

    async def one(i: int, prompt: str) -> int:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            r = await http.post("/v1/completions", json={
                "model": models[i % len(models)], "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(counts), "tok_per_s": sum(counts) / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/multi_adapter.json"))
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from loopline.common.config.settings import InferenceSettings
    from loopline.common.local.stack import LocalStack
    from loopline.ml.models.resolve import resolve_model

    settings = InferenceSettings()
    models_dir = REPO / ".loopline" / "models"
    model = str(resolve_model(args.model, models_dir))
    prompts = make_prompts(args.prompts)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="loopline-multi-adapter-"))
    # max_adapters is vLLM's max_loras (adapters mixed in one batch) and the replica's LRU bound:
    # at least --adapters, or the mixed stream would be evicting and reloading all the time.
    max_adapters = max(settings.max_adapters, args.adapters)
    stack = LocalStack(state_dir, model, replicas=1, models_dir=models_dir,
                       env={"LOOPLINE_MAX_ADAPTERS": str(max_adapters)})
    print(f"starting LocalStack in {state_dir} ({model}); max_adapters = max_loras = {max_adapters}, "
          f"max_inflight = {settings.max_inflight}", flush=True)
    stack.start()
    passes: dict[str, list[dict]] = {"base": [], "one": [], "mixed": []}
    try:
        jobs = asyncio.run(deploy(stack, model, args.adapters))
        modes = {"base": [model], "one": [jobs[0]], "mixed": jobs}
        print(f"deployed {len(jobs)} Tokenformer adapters; {args.prompts} prompts x {args.max_tokens} "
              f"tokens, greedy, all in flight", flush=True)
        for targets in modes.values():  # warm-up, not counted
            asyncio.run(one_pass(stack.url, targets, prompts[:32], args.max_tokens))
        for r in range(args.repeats):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for name in order:
                p = asyncio.run(one_pass(stack.url, modes[name], prompts, args.max_tokens))
                passes[name].append(p)
                print(f"  round {r + 1} {name:5s}: {p['tok_per_s']:8.1f} tok/s ({p['tokens']} tokens in "
                      f"{p['wall_s']:.2f} s)", flush=True)
    finally:
        stack.stop()

    median = {name: statistics.median(p["tok_per_s"] for p in ps) for name, ps in passes.items()}
    mixed_ratio = median["mixed"] / median["one"]
    adapter_ratio = median["one"] / median["base"]
    ok = mixed_ratio >= TARGET_MIXED_RATIO
    print(f"\n(i) base {median['base']:.1f} tok/s, (ii) one adapter {median['one']:.1f} tok/s, "
          f"(iii) {args.adapters} adapters mixed {median['mixed']:.1f} tok/s (medians of {args.repeats})")
    print(f"  (iii)/(ii) = {mixed_ratio:.2f}  target >= {TARGET_MIXED_RATIO}: {'PASS' if ok else 'MISS'}")
    print(f"  (ii)/(i)   = {adapter_ratio:.2f}  (information: the adapter path against the base model)")
    out = {"target_mixed_ratio": TARGET_MIXED_RATIO, "pass": ok, "mixed_over_one": mixed_ratio,
           "one_over_base": adapter_ratio, "median_tok_per_s": median, "passes": passes,
           "settings": {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                        "adapters": args.adapters, "adapter_type": "tokenformer",
                        "max_adapters": max_adapters, "max_inflight": settings.max_inflight,
                        "repeats": args.repeats},
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg": os.getloadavg()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
