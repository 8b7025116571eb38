"""Which weights a Tinker sample request was drawn from, stamped on the request the gateway stores
beside its future (``tinker.futures.<request id>.request``, as NATS headers).

The session worker reads it back when a forward_backward's provenance names one of the request's
sequences (``<request id>:<i>``), to say how many optimizer steps behind the trainer each trained
sample was: the per-step staleness of an async RL run (issue 26; Laminar reports it, no open Tinker
server did). A request drawn from the base model, or through a path of no training run, has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MODEL_HEADER = "Loopline-Sampler-Model"
STEP_HEADER = "Loopline-Sampler-Step"


@dataclass(frozen=True)
class SamplerVersion:
    model_id: str  # the training run (Tinker model id) whose saved weights drew the samples
    step: int  # its optimizer steps when those weights were saved

    def headers(self) -> dict[str, str]:
        return {MODEL_HEADER: self.model_id, STEP_HEADER: str(self.step)}

    @classmethod
    def of_headers(cls, headers: Mapping[str, str] | None) -> SamplerVersion | None:
        """The stamp in a stored request's headers; None when it has none (or not a valid one)."""
        if not headers:
            return None
        model, step = headers.get(MODEL_HEADER), headers.get(STEP_HEADER)
        if not model or step is None or not step.isdigit():
            return None
        return cls(model, int(step))
