"""The tinker SDK 0.38's protobuf bodies, to and from plain Python and numpy.

    request   ``POST /api/v1/forward_backward``: a ``ForwardBackwardRequest`` (zstd when the server's
              ``client/config`` turned ``proto_compress_fwdbwd`` on) -> ``FwdBwdCall``
    results   ``retrieve_future`` with ``Accept: application/x-protobuf``: ``ForwardBackwardOutput``
              and ``SampleResponse``, encoded here and decoded by the SDK's ``response_conv``

The message types are the SDK's own (``tinker.proto.tinker_public_pb2``); the SDK's
``request_conv`` / ``response_conv`` are what the tests check these against. Every malformed body is
a ``ValueError`` that names the part at fault, so the gateway answers it with a 4xx.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import zstandard
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # no stubs in .venv
from tinker.proto import tinker_public_pb2 as pb

# The only dtypes the SDK writes into a request (request_conv._TENSOR_DTYPE_TO_PROTO).
_REQUEST_DTYPES: dict[int, np.dtype] = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8")}
# A decoded body may not outgrow this: a few kilobytes of zstd can claim gigabytes. The SDK splits
# forward_backward calls at 5 MB of serialized proto (ClientConfigResponse), so 256 MiB is far above
# any honest body.
MAX_BODY_BYTES = 256 << 20
# The largest dense tensor a sparse one may expand to (elements): 64 Mi float32 is 256 MiB.
MAX_DENSE_ELEMENTS = 64 << 20
# An empty cell of a TopkLogprobs matrix (tinker.types.topk_logprobs.MASK_LOGPROB).
TOPK_EMPTY = (0, -99999.0)

StopReason = Literal["stop", "length"]
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


@dataclass
class ProtoDatum:
    """One datum of a forward_backward call: its tokens, and its loss inputs as dense arrays (the
    worker's ``Datum`` has the same two fields; libs/common does not import loopline.ml)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class FwdBwdCall:
    model_id: str
    seq_id: int | None  # None: the body left it 0 (unset)
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[ProtoDatum]


@dataclass
class SampledSeq:
    """One sampled sequence as ``encode_sample_response`` takes it."""

    tokens: list[int]
    stop_reason: StopReason
    logprobs: list[float] | None = None  # one per token
    topk: list[list[tuple[int, float]] | None] | None = None  # one row per token, best first


def request_body(body: bytes, content_encoding: str | None, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """A forward_backward body with its ``Content-Encoding`` undone (the SDK sends ``zstd`` or none)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "zstd":
        raise ValueError(f"Content-Encoding {content_encoding!r} is not supported: send zstd or none")
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        parts: list[bytes] = []
        size = 0
        # Invariant: parts hold the first `size` decoded bytes, and size <= max_bytes.
        while chunk := reader.read(1 << 20):
            size += len(chunk)
            if size > max_bytes:
                raise ValueError(f"the zstd body decodes to more than {max_bytes} bytes")
            parts.append(chunk)
    except zstandard.ZstdError as e:
        raise ValueError(f"the body is not valid zstd: {e}") from e
    return b"".join(parts)


def _parse_request(body: bytes, content_encoding: str | None) -> pb.ForwardBackwardRequest:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(request_body(body, content_encoding))
    except DecodeError as e:
        raise ValueError(f"the body is not a tinker ForwardBackwardRequest: {e}") from e
    if not message.model_id:
        raise ValueError("the ForwardBackwardRequest has no model_id")
    if message.seq_id < 0:
        raise ValueError(f"seq_id must be 1 or more, not {message.seq_id}")
    return message


def peek_forward_backward(body: bytes, content_encoding: str | None = None) -> tuple[str, int | None]:
    """(model_id, seq_id) of a forward_backward body, for routing; the tensors stay undecoded."""
    message = _parse_request(body, content_encoding)
    return message.model_id, message.seq_id or None


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> FwdBwdCall:
    """A forward_backward body as plain values. Provenance spans (StableReinforce's references to
    sampled sequences) are dropped: this server records no stability info to resolve them against."""
    message = _parse_request(body, content_encoding)
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


def _datum(index: int, datum: pb.Datum) -> ProtoDatum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"data[{index}]: {kind or 'empty'} chunks: image inputs are not supported by "
                             "this server (it trains text models); send encoded_text chunks only")
        tokens.extend(_frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"),
                                  f"data[{index}].model_input tokens").tolist())
    inputs = {name: _tensor(tensor, f"data[{index}].loss_fn_inputs[{name!r}]")
              for name, tensor in datum.loss_fn_inputs.items()}
    return ProtoDatum(tokens=tokens, inputs=inputs)


def _frombuffer(data: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{where}: {len(data)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(data, dtype=dtype)


def _tensor(tensor: pb.Tensor, where: str) -> np.ndarray:
    """A request tensor as a dense, writable array; a sparse CSR one is densified with 0 in every
    unlisted cell, as the SDK's ``TensorData.to_numpy()`` does by default."""
    dtype = _REQUEST_DTYPES.get(tensor.dtype)
    if dtype is None:
        name = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else str(tensor.dtype)
        raise ValueError(f"{where}: dtype {name} is not accepted; send float32 or int64")
    shape = [int(s) for s in tensor.shape]
    if any(s < 0 for s in shape):
        raise ValueError(f"{where}: negative shape {shape}")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _densify(tensor.sparse_csr, dtype, shape, where)
    values = _frombuffer(tensor.dense, dtype, where)
    if not shape:
        return values.copy()
    if int(np.prod(shape)) != values.size:
        raise ValueError(f"{where}: {values.size} values do not fill shape {shape}")
    return values.reshape(shape).copy()


def _densify(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise ValueError(f"{where}: a sparse CSR tensor needs a 2-D shape, not {shape}")
    rows, cols = shape
    if rows * cols > MAX_DENSE_ELEMENTS:
        raise ValueError(f"{where}: shape {shape} is over {MAX_DENSE_ELEMENTS} elements")
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


def encode_sample_response(sequences: Sequence[SampledSeq],
                           prompt_logprobs: Sequence[float | None] | None = None,
                           topk_prompt_logprobs: Sequence[list[tuple[int, float]] | None] | None = None, *,
                           sample_k: int = 0, prompt_k: int = 0,
                           target_prompt_logprobs: TargetLogprobs | None = None,
                           prompt_cache_hit_tokens: int = 0) -> bytes:
    """A ``SampleResponse``. ``prompt_logprobs`` has one entry per prompt token, None where there is
    none (position 0). ``sample_k`` and ``prompt_k`` are the k the request asked for
    (``topk_sample_logprobs``, ``topk_prompt_logprobs``): the widths of the top-k matrices, whose
    short rows are padded with empty cells. Sequence ids are not in the proto: the asample reply
    carries them."""
    message = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for seq in sequences:
        out = message.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason],
                                    tokens=np.asarray(seq.tokens, dtype="<i4").tobytes())
        if seq.logprobs is not None:
            if len(seq.logprobs) != len(seq.tokens):
                raise ValueError(f"{len(seq.logprobs)} logprobs for {len(seq.tokens)} tokens")
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk is not None:
            if len(seq.topk) != len(seq.tokens):
                raise ValueError(f"{len(seq.topk)} top-k rows for {len(seq.tokens)} tokens")
            out.topk_sampled_logprobs.CopyFrom(_topk(seq.topk, sample_k))
    if prompt_logprobs is not None:
        out_prompt = [np.nan if lp is None else lp for lp in prompt_logprobs]
        message.prompt_logprobs = np.asarray(out_prompt, dtype="<f4").tobytes()
    if topk_prompt_logprobs is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt_logprobs, prompt_k))
    if target_prompt_logprobs is not None:
        message.target_prompt_logprobs.CopyFrom(target_prompt_logprobs.to_proto())
    return bytes(message.SerializeToString())


def _topk(rows: Sequence[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    if k < 1:
        raise ValueError("top-k logprobs need k >= 1")
    ids = np.full((len(rows), k), TOPK_EMPTY[0], dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_EMPTY[1], dtype="<f4")
    # Invariant: rows [0, i) are filled, best first, with at most k cells each.
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))


@dataclass
class TargetLogprobs:
    """The answer to a request's ``target_prompt_logprobs``: float32 values in the request tensor's
    layout (dense ``shape``, or the same CSR indices when it was sparse)."""

    values: np.ndarray
    shape: list[int]
    crow_indices: list[int] | None = None
    col_indices: list[int] | None = None

    def to_proto(self) -> pb.Tensor:
        tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=self.shape)
        values = np.ascontiguousarray(self.values, dtype="<f4").tobytes()
        if self.crow_indices is None:
            tensor.dense = values
        else:
            tensor.sparse_csr.CopyFrom(pb.SparseCsr(
                values=values, crow_indices=np.asarray(self.crow_indices, dtype="<i8").tobytes(),
                col_indices=np.asarray(self.col_indices or [], dtype="<i8").tobytes()))
        return tensor
