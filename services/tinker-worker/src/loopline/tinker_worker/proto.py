"""The tinker SDK 0.38's forward_backward protobuf, as the session worker reads and answers it.

    request   the ``ForwardBackwardRequest`` the SDK posted (the gateway undid its zstd and read
              only its routing fields) -> ``FwdBwdCall``, its data as the SDK's own ``Datum``
    result    ``ForwardBackwardOutput``, which ``retrieve_future`` relays and the SDK decodes with
              its ``response_conv``

This is the one place the request is parsed. The message types are the SDK's own
(``tinker.proto.tinker_public_pb2``); its ``request_conv`` / ``response_conv`` are what the tests
check these against. A malformed body is a ``ValueError`` that names the part at fault: the caller's
mistake, which the worker answers with a ``user`` error. So is a body that would expand past its
``RequestBounds``: a sparse tensor of a few bytes can claim gigabytes, so every shape is sized before
any array is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # no stubs in .venv
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

# The only dtypes the SDK writes into a request (request_conv._TENSOR_DTYPE_TO_PROTO).
_REQUEST_DTYPES: dict[int, np.dtype] = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8")}
TOKEN_BYTES = 4  # a model input token, as the body carries it (int32)
MAX_REQUEST_BYTES_SETTING = "LOOPLINE_TINKER_MAX_REQUEST_BYTES"
# A sequence id this server hands out is ``<request id>:<index>``, well under this.
MAX_SEQUENCE_ID_CHARS = 256


@dataclass(frozen=True)
class RequestBounds:
    """What one body may make the worker allocate. Without them, four datums of [512, 131072]
    sparse tensors holding no value (400 KB) grew the worker by 7 GB, for every tenant on it."""

    max_bytes: int  # every datum's tokens and loss inputs, dense (TinkerWorkerSettings)
    max_tokens: int | None = None  # a datum's length: the model's context
    vocab_size: int | None = None  # the width of a 2-D input: K candidate tokens a position


@dataclass
class FwdBwdCall:
    model_id: str
    seq_id: int | None  # None: the body left it 0 (unset)
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    # Each datum's loss inputs are dense (a sparse CSR one is densified here, bounded).
    data: list[tt.Datum]


def decode_forward_backward(body: bytes, bounds: RequestBounds) -> FwdBwdCall:
    """A forward_backward body as the SDK's types, provenance spans (which sampled sequence each
    position came from: StableReinforce trains on the sampled ones) included; refused before any
    array is made when it would outgrow ``bounds``."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as e:
        raise ValueError(f"the body is not a tinker ForwardBackwardRequest: {e}") from e
    check_bounds(message, bounds)
    config: dict[str, float | str] = dict(message.loss_fn_config)
    # v2 wins where both name a key: the SDK dual-writes numbers and puts strings only in v2.
    for key, value in message.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise ValueError(f"loss_fn_config[{key!r}] has no value")
        config[key] = value.number if kind == "number" else value.text
    data = [_datum(i, datum) for i, datum in enumerate(message.data)]
    return FwdBwdCall(model_id=message.model_id, seq_id=message.seq_id or None, loss_fn=message.loss_fn,
                      loss_fn_config=config, forward_only=message.forward_only, data=data)


def check_bounds(message: pb.ForwardBackwardRequest, bounds: RequestBounds) -> None:
    """Each datum's length against the context, each 2-D input's width against the vocabulary, and
    the whole request's dense size against ``max_bytes``, all read from lengths and shapes."""
    total = cells = 0
    for i, datum in enumerate(message.data):
        n = sum(len(chunk.encoded_text.tokens) // TOKEN_BYTES for chunk in datum.model_input)
        if bounds.max_tokens is not None and n > bounds.max_tokens:
            raise ValueError(f"data[{i}]: {n} tokens, more than the model's context of {bounds.max_tokens} "
                             "(its max_position_embeddings)")
        total, cells = total + n * TOKEN_BYTES, cells + n
        for name, tensor in datum.loss_fn_inputs.items():
            where = f"data[{i}].loss_fn_inputs[{name!r}]"
            shape, itemsize = _shape(tensor, where), _dtype(tensor, where).itemsize
            if bounds.vocab_size is not None and len(shape) == 2 and shape[1] > bounds.vocab_size:
                raise ValueError(f"{where}: shape {shape} has {shape[1]} candidates a position, more than "
                                 f"the model's vocabulary of {bounds.vocab_size} tokens")
            size = math.prod(shape) if shape else len(tensor.dense) // itemsize
            total, cells = total + size * itemsize, cells + size
    if total > bounds.max_bytes:
        raise ValueError(f"the request's {len(message.data)} datums expand to {cells} cells ({total} bytes) "
                         f"dense; the limit is {bounds.max_bytes} bytes (`{MAX_REQUEST_BYTES_SETTING}`): "
                         "send fewer or smaller datums in one call")


def _datum(index: int, datum: pb.Datum) -> tt.Datum:
    chunks: list[tt.ModelInputChunk] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"data[{index}]: {kind or 'empty'} chunks: image inputs are not supported by "
                             "this server (it trains text models); send encoded_text chunks only")
        tokens = _frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), f"data[{index}].model_input tokens")
        chunks.append(tt.EncodedTextChunk(tokens=tokens.tolist()))
    inputs = {name: tt.TensorData.from_numpy(_tensor(tensor, f"data[{index}].loss_fn_inputs[{name!r}]"))
              for name, tensor in datum.loss_fn_inputs.items()}
    model_spans = _spans(datum.model_input_spans, f"data[{index}].model_input_spans")
    loss_spans = _spans(datum.loss_fn_input_spans, f"data[{index}].loss_fn_input_spans")
    if (model_spans is None) != (loss_spans is None):
        raise ValueError(f"data[{index}]: provenance comes as a pair: set both model_input_spans and "
                         "loss_fn_input_spans, or neither")
    return tt.Datum(model_input=tt.ModelInput(chunks=chunks), loss_fn_inputs=inputs,
                    model_input_spans=model_spans, loss_fn_input_spans=loss_spans)


def _spans(spans: Sequence[pb.ProvenanceSpan], where: str) -> tt.ProvenanceSpans | None:
    """Provenance runs as the SDK's span types; None when the datum sent none (an empty list is
    what the SDK sends for no runs, and reads back as none)."""
    out: tt.ProvenanceSpans = []
    for j, span in enumerate(spans):
        arm = span.WhichOneof("span")
        if arm is None:
            raise ValueError(f"{where}[{j}] names neither prompt_tokens nor sampled_tokens")
        run = getattr(span, arm)
        kind = tt.SampledProvenanceSpan if arm == "sampled_tokens" else tt.PromptProvenanceSpan
        if len(run.sequence_id) > MAX_SEQUENCE_ID_CHARS:
            raise ValueError(f"{where}[{j}].sequence_id is over {MAX_SEQUENCE_ID_CHARS} characters")
        try:
            out.append(kind(sequence_id=run.sequence_id, offset=run.offset, length=run.length))
        except ValueError as e:  # a negative length or offset, an empty sequence id
            raise ValueError(f"{where}[{j}]: {e}") from None
    return out or None


def _frombuffer(data: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{where}: {len(data)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(data, dtype=dtype)


def _tensor(tensor: pb.Tensor, where: str) -> np.ndarray:
    """A request tensor as a dense, writable array; a sparse CSR one is densified with 0 in every
    unlisted cell, as the SDK's ``TensorData.to_numpy()`` does by default (its size checked
    already: ``check_bounds``)."""
    dtype, shape = _dtype(tensor, where), _shape(tensor, where)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _densify(tensor.sparse_csr, dtype, shape, where)
    values = _frombuffer(tensor.dense, dtype, where)
    if not shape:
        return values.copy()
    if int(np.prod(shape)) != values.size:
        raise ValueError(f"{where}: {values.size} values do not fill shape {shape}")
    return values.reshape(shape).copy()


def _dtype(tensor: pb.Tensor, where: str) -> np.dtype:
    dtype = _REQUEST_DTYPES.get(tensor.dtype)
    if dtype is None:
        name = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else str(tensor.dtype)
        raise ValueError(f"{where}: dtype {name} is not accepted; send float32 or int64")
    return dtype


def _shape(tensor: pb.Tensor, where: str) -> list[int]:
    shape = [int(s) for s in tensor.shape]
    if any(s < 0 for s in shape):
        raise ValueError(f"{where}: negative shape {shape}")
    return shape


def _densify(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise ValueError(f"{where}: a sparse CSR tensor needs a 2-D shape, not {shape}")
    rows, cols = shape
    values = _frombuffer(csr.values, dtype, where)
    crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{where} crow_indices")
    col = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{where} col_indices")
    if (len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(values) or len(col) != len(values)
            or np.any(np.diff(crow) < 0) or np.any(col < 0) or np.any(col >= cols)):
        raise ValueError(f"{where}: inconsistent CSR indices for shape {shape} and {len(values)} values")
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def encode_forward_backward_output(loss_fn_output_type: str, outputs: Sequence[dict[str, np.ndarray]],
                                   metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: per datum, named float32 / int64 arrays (ragged only in their
    leading dimension), and metrics keyed ``name:reduction``."""
    for key in metrics:
        # The SDK reduces metrics across chunks by key.split(":"): any other key crashes the client.
        if key.count(":") != 1:
            raise ValueError(f"metric key {key!r} is not name:reduction")
    message = pb.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type,
                                       metrics={k: float(v) for k, v in metrics.items()})
    arrays = [{name: _output_array(i, name, value) for name, value in out.items()} for i, out in
              enumerate(outputs)]
    names = sorted(arrays[0]) if arrays else []
    for i, out in enumerate(arrays):
        if sorted(out) != names:
            raise ValueError(f"outputs[{i}] has fields {sorted(out)}; outputs[0] has {names}")
    start = 0
    # Invariant: datums [0, start) are in records already. A record holds a run of datums whose
    # fields agree on dtype and trailing shape (one BatchedTensor per field cannot mix them).
    while start < len(arrays):
        signature = _signature(arrays[start])
        end = start + 1
        while end < len(arrays) and _signature(arrays[end]) == signature:
            end += 1
        record = message.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=end - start)
        for name in names:
            run = [arrays[i][name] for i in range(start, end)]
            offsets = np.cumsum([0] + [a.nbytes for a in run], dtype=np.int64)
            record.fields[name].CopyFrom(pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in run), offsets=offsets.astype("<i8").tobytes(),
                dtype=pb.DTYPE_FLOAT32 if run[0].dtype == np.float32 else pb.DTYPE_INT64,
                trailing_shape=list(run[0].shape[1:])))
        start = end
    return bytes(message.SerializeToString())


def _output_array(index: int, name: str, value: np.ndarray) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind == "f":
        array = array.astype("<f4", copy=False)
    elif array.dtype.kind in "iu":
        array = array.astype("<i8", copy=False)
    else:
        raise ValueError(f"outputs[{index}][{name!r}]: dtype {array.dtype} is neither float nor int")
    return np.ascontiguousarray(array.reshape(1) if array.ndim == 0 else array)


def _signature(arrays: dict[str, np.ndarray]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, a.dtype.str, a.shape[1:]) for name, a in sorted(arrays.items())]
