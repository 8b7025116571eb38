"""The session worker's own types: a pass's result, and the error that is the caller's fault.

A call's data and AdamW's parameters are the SDK's own types (``tinker.types.Datum``,
``tinker.types.AdamParams``), decoded once by ``proto`` (forward_backward) or parsed by the SDK's
request models (optim_step), and handed to the compute (``training.TrainingClients``) as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class UserError(ValueError):
    """The request cannot run as sent (unknown loss, a missing or misshapen input, a checkpoint that
    does not fit): the SDK gets a ``user`` error and fails fast instead of retrying."""


@dataclass
class PassResult:
    """What a forward_backward (or forward-only) pass returns: one dict of arrays per datum, in the
    order the data came (``logprobs``: float32, shape (N,), aligned with ``target_tokens``), and
    metrics keyed ``name:reduction`` (the SDK splits keys on ':' to merge chunks)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
