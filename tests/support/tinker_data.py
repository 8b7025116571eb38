"""Tinker data for the tests, in the SDK's own types: a datum from token ids and loss inputs (the
worker computes on these), its tokens and inputs back as arrays, and the forward_backward body the
SDK 0.38 posts for some data (encoded by the SDK's own ``request_conv``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from tinker import types as tt
from tinker.proto.request_conv import forward_backward_request_to_proto


def make_datum(tokens: list[int], inputs: Mapping[str, Any] | None = None) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints(list(tokens)), loss_fn_inputs=dict(inputs or {}))


def tokens_of(d: tt.Datum) -> list[int]:
    return d.model_input.to_ints()


def inputs_of(d: tt.Datum) -> dict[str, np.ndarray]:
    return {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}


def sdk_datum(tokens: list[int], **inputs: object) -> tt.Datum:
    """A datum as a client writes one: loss inputs as lists, arrays or the SDK's TensorData."""
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def sdk_body(data: list[tt.Datum], *, seq_id: int | None = 7, forward_only: bool = False,
             loss_fn: str = "cross_entropy", config: dict[str, float | str] | None = None) -> bytes:
    """The bytes the SDK 0.38 posts to /api/v1/forward_backward (uncompressed)."""
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="ab" * 16 + ":train:0", seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return bytes(message.SerializeToString())


def token_rows_data(vocab: int, rows: int, length: int, seed: int) -> list[tt.Datum]:
    """``rows`` datums of ``length`` random token ids, a cross-entropy on every target."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(rows):
        ids = rng.integers(3, vocab, length + 1).tolist()
        data.append(make_datum(ids[:-1], {"target_tokens": np.asarray(ids[1:], np.int64),
                                          "weights": np.ones(length, np.float32)}))
    return data
