"""The reference engine: plain transformers, one request at a time, in a worker thread.

It is the yardstick the vLLM path is checked against and the fallback where vLLM is not installed.
Its decode loop is written out (KV cache, sampling, stop strings) rather than calling
``model.generate`` so it can emit a delta per token exactly like vLLM does.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from loopline.inference.engine import (
    AdapterRejected,
    Delta,
    Engine,
    EngineInfo,
    GenerationRequest,
    Sampling,
    decode_text,
)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters might be the start of a stop string and must wait."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                longest = max(longest, k)
                break
    return longest


class ReferenceEngine(Engine):
    def __init__(self, model_path: str, *, max_model_len: int | None, dtype: str,
                 adapter: str | Path | None = None):
        self.model_path = model_path
        # A training checkpoint folder (any adapter kind) to apply on top of the base model.
        self.adapter = adapter
        self.max_model_len = max_model_len
        self.dtype = dtype
        # One forward pass at a time: the model is shared and CPU threads are few.
        self._lock = threading.Lock()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).eval()
        if self.adapter is not None:
            from loopline.ml.adapters import apply_adapter

            self.model = apply_adapter(self.model, self.adapter)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        config_len = getattr(self.model.config, "max_position_embeddings", 2048)
        self.info = EngineInfo(name="reference", max_model_len=self.max_model_len or config_len)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {e for e in [*eos, self.tokenizer.eos_token_id] if e is not None}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

        def emit(item: Delta | BaseException | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def run() -> None:
            try:
                with self._lock:
                    for choice in range(request.sampling.n):
                        self._decode(request, choice, emit)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                emit(exc)
            finally:
                emit(None)

        threading.Thread(target=run, daemon=True, name=f"ref-{request.request_id}").start()
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _decode(self, request: GenerationRequest, choice: int, emit) -> None:
        import torch

        # An adapter version is a whole adapted copy of the model (load_adapter).
        model = self.model if request.adapter is None else request.adapter
        s: Sampling = request.sampling
        generator = torch.Generator()
        if s.seed is not None:
            generator.manual_seed(s.seed + choice)
        ids: list[int] = []
        sent = ""
        past = None
        inputs = torch.tensor([request.prompt_token_ids])
        finish = "length"
        with torch.inference_mode():
            for _ in range(s.max_tokens):
                if request.request_id in self._aborted:
                    finish = "abort"
                    break
                out = model(input_ids=inputs, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = self._sample(out.logits[0, -1].float(), s, generator)
                if token in self.eos_ids:
                    finish = "stop"
                    break
                ids.append(token)
                inputs = torch.tensor([[token]])
                text = decode_text(self.tokenizer, ids)
                if text.endswith("\ufffd"):
                    continue  # half a multi-byte character: wait for the rest
                if any(stop in text for stop in s.stop):
                    finish = "stop"
                    break
                ready = text[: len(text) - held_back(text, s.stop)]
                if len(ready) > len(sent):
                    emit(Delta(choice, ready[len(sent):], len(ids)))
                    sent = ready
        # Flush what was held back, cut at the first stop string (which is never sent).
        text = decode_text(self.tokenizer, ids)
        cut = min((text.find(stop) for stop in s.stop if stop in text), default=-1)
        if cut >= 0:
            text = text[:cut]
        self._aborted.discard(request.request_id)
        emit(Delta(choice, text[len(sent):], len(ids), finish))

    @staticmethod
    def _sample(logits, s: Sampling, generator) -> int:
        import torch

        if s.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / s.temperature, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < s.top_p
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def load_adapter(self, name: str, checkpoint_dir: Path, config: dict[str, Any]) -> Any:
        """A copy of the base model with the checkpoint applied: any kind, full weights included.
        Simple rather than lean (a version costs a model's memory): this engine is the yardstick
        and the fallback, and the replica's LRU bound caps how many copies live at once."""
        from loopline.ml.adapters import apply_adapter

        def load():
            return apply_adapter(copy.deepcopy(self.model), checkpoint_dir)

        try:
            return await asyncio.to_thread(load)
        except (ValueError, KeyError) as exc:  # tensors or config that do not fit this model
            raise AdapterRejected(f"the checkpoint does not fit {self.model_path}: {exc}") from exc

    async def unload_adapter(self, handle: Any) -> None:
        pass  # the copy is freed with the last reference to it

    async def stop(self) -> None:
        self.model = None
