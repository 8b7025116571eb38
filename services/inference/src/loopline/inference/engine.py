"""The engine interface every backend implements, and the internal types it speaks.

An engine takes a tokenized prompt and sampling settings and yields text deltas. Prompt building
(chat template, tokenization, context-length checks) happens before, in ``prompts.py``, the same way
for every engine, so the vLLM engine and the reference engine see identical token ids.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


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


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent: fall back, don't crash
        return False
    return True


def make_engine(kind: str, model_path: str, *, max_model_len: int | None, max_inflight: int,
                dtype: str) -> Engine:
    """``auto`` picks vLLM where it imports and the transformers reference engine elsewhere."""
    if kind == "auto":
        kind = "vllm" if vllm_available() else "reference"
    if kind == "vllm":
        from loopline.inference.vllm_engine import VllmEngine

        return VllmEngine(model_path, max_model_len=max_model_len, max_num_seqs=max_inflight, dtype=dtype)
    from loopline.inference.reference_engine import ReferenceEngine

    return ReferenceEngine(model_path, max_model_len=max_model_len, dtype=dtype)
