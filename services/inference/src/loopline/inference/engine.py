"""The engine interface every backend implements, and the internal types it speaks.

An engine takes a tokenized prompt and sampling settings and yields text deltas. Prompt building
(chat template, tokenization, context-length checks) happens before, in ``prompts.py``, the same way
for every engine, so the vLLM engine and the reference engine see identical token ids.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    # False when nobody watches the tokens arrive: an engine may then yield only the final delta.
    stream: bool = True
    # What ``Engine.load_adapter`` returned for the adapter version to generate with; None: base.
    adapter: Any = None


@dataclass
class Delta:
    """New text for one choice. ``tokens`` counts the choice's generated tokens so far; a delta with
    ``finish_reason`` set is the choice's last."""

    choice: int
    text: str
    tokens: int
    finish_reason: str | None = None


@dataclass
class EngineInfo:
    name: str
    max_model_len: int
    extra: dict = field(default_factory=dict)


class AdapterRejected(Exception):
    """This engine cannot serve this checkpoint, whatever we retry (the message says why)."""


class Engine(abc.ABC):
    info: EngineInfo

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; after this ``info`` is filled in."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Yield deltas until every choice has finished."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request early (its consumer went away)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the model."""

    async def load_adapter(self, name: str, checkpoint_dir: Path, config: dict[str, Any]) -> Any:
        """Load one checkpoint (docs/adapter-format.md) as a new adapter version and return the
        handle requests name it by (``GenerationRequest.adapter``). ``name`` is unique per version.
        The version must be servable when this returns. Raises ``AdapterRejected``."""
        raise AdapterRejected(f"the {self.info.name} engine does not load adapters")

    async def unload_adapter(self, handle: Any) -> None:  # noqa: B027 - engines without adapters free nothing
        """Free a version no request uses any more."""


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent: fall back, don't crash
        return False
    return True


def decode_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """One sequence's text, special tokens left out (transformers types decode() for a batch too,
    as ``str | list[str]``; one sequence decodes to one str)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert isinstance(text, str)
    return text


def build_engine(kind: str, model_path: str, *, max_model_len: int | None, max_inflight: int,
                 dtype: str, adapters: bool = False, max_adapters: int = 4,
                 max_adapter_rank: int = 64) -> Engine:
    """The inference engine of ``kind`` for the model folder ``model_path``, not started yet.
    ``auto`` picks vLLM where it imports and the transformers reference engine elsewhere."""
    if kind == "auto":
        kind = "vllm" if vllm_available() else "reference"
    if kind == "vllm":
        from loopline.inference.vllm_engine import VllmEngine

        return VllmEngine(model_path, max_model_len=max_model_len, max_num_seqs=max_inflight, dtype=dtype,
                          enable_lora=adapters, max_loras=max_adapters, max_lora_rank=max_adapter_rank)
    from loopline.inference.reference_engine import ReferenceEngine

    return ReferenceEngine(model_path, max_model_len=max_model_len, dtype=dtype)
