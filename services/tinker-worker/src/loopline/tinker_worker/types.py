"""The session worker's internal types: one datum of a forward_backward call, AdamW's parameters,
a pass's result, and the error that is the caller's fault.

These sit between the wire (the SDK's protobuf and JSON, decoded by the worker loop) and the compute
(``training.TrainingClients``): plain dataclasses of Python lists and numpy arrays, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class UserError(ValueError):
    """The request cannot run as sent (unknown loss, a missing or misshapen input, a checkpoint that
    does not fit): the SDK gets a ``user`` error and fails fast instead of retrying."""


@dataclass
class Datum:
    """One sequence of a forward_backward call.

    ``tokens`` is the model input (its encoded_text chunks concatenated), N tokens. ``inputs`` is the
    datum's ``loss_fn_inputs``; each array has shape (N,) and is aligned with the input: position i
    of ``target_tokens`` is the token the model should predict after reading ``tokens[: i + 1]``.
    """

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class AdamParams:
    """The SDK's ``AdamParams`` (its defaults; eps is 1e-12 there too)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0  # decoupled (AdamW)
    grad_clip_norm: float = 0.0  # clip the global gradient norm to this; 0 means no clipping


@dataclass
class PassResult:
    """What a forward_backward (or forward-only) pass returns: one dict of arrays per datum, in the
    order the data came (``logprobs``: float32, shape (N,), aligned with ``target_tokens``), and
    metrics keyed ``name:reduction`` (the SDK splits keys on ':' to merge chunks)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
