"""The tinker SDK 0.38's protobuf bodies as the gateway handles them.

    request   ``POST /api/v1/forward_backward``: a ``ForwardBackwardRequest`` (zstd when the server's
              ``client/config`` turned ``proto_compress_fwdbwd`` on). The gateway undoes the zstd,
              reads the routing fields (``route_of``) and sizes the data from its shapes
              (``dense_size``); the session worker decodes the data, once
              (loopline.tinker_worker.proto).
    results   ``retrieve_future`` with ``Accept: application/x-protobuf``: a sample's
              ``SampleResponse``, encoded here and decoded by the SDK's ``response_conv`` (a
              forward_backward's ``ForwardBackwardOutput`` comes encoded from the worker)

The message types are the SDK's own (``tinker.proto.tinker_public_pb2``); the SDK's
``request_conv`` / ``response_conv`` are what the tests check these against. Every malformed body is
a ``ValueError`` that names the part at fault, so the gateway answers it with a 4xx.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import zstandard
from google.protobuf import (  # type: ignore[import-untyped]  # no stubs in .venv
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # no stubs in .venv
from tinker.proto import tinker_public_pb2 as pb

# A decoded body may not outgrow this: a few kilobytes of zstd can claim gigabytes. The SDK splits
# forward_backward calls at 5 MB of serialized proto (ClientConfigResponse), so 256 MiB is far above
# any honest body.
MAX_BODY_BYTES = 256 << 20
# Bytes a cell of a request tensor, by dtype (the SDK writes float32 and int64; the worker refuses
# others, and they are sized as the widest here); a model input token is an int32.
_CELL_BYTES = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_INT64: 8}
_TOKEN_BYTES = 4
# An empty cell of a TopkLogprobs matrix (tinker.types.topk_logprobs.MASK_LOGPROB).
TOPK_EMPTY = (0, -99999.0)

StopReason = Literal["stop", "length"]
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


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


def _route_message() -> type:
    """A message of the request's routing fields alone, with the SDK's own numbers and types: the
    datums are skipped over, not decoded (the worker decodes them)."""
    full = descriptor_pb2.DescriptorProto()
    pb.ForwardBackwardRequest.DESCRIPTOR.CopyToProto(full)
    file = descriptor_pb2.FileDescriptorProto(name="loopline/forward_backward_route.proto",
                                              package="loopline", syntax="proto3")
    file.message_type.add(name="ForwardBackwardRoute").field.extend(
        f for f in full.field if f.name in ("model_id", "seq_id"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("loopline.ForwardBackwardRoute"))


_Route = _route_message()


def route_of(body: bytes) -> tuple[str, int | None]:
    """(model_id, seq_id) of a forward_backward body (zstd undone), for routing; seq_id None when
    the body left it unset."""
    message = _Route()
    try:
        message.ParseFromString(body)
    except DecodeError as e:
        raise ValueError(f"the body is not a tinker ForwardBackwardRequest: {e}") from e
    if not message.model_id:
        raise ValueError("the ForwardBackwardRequest has no model_id")
    if message.seq_id < 0:
        raise ValueError(f"seq_id must be 1 or more, not {message.seq_id}")
    return message.model_id, message.seq_id or None


@dataclass(frozen=True)
class DenseSize:
    """What a forward_backward body's data would be, every tensor dense."""

    datums: int
    cells: int
    bytes: int


def dense_size(body: bytes) -> DenseSize:
    """The size of a forward_backward body's tokens and loss inputs once densified, read from
    token lengths and shapes alone (a sparse tensor claims its shape whatever it stores)."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as e:
        raise ValueError(f"the body is not a tinker ForwardBackwardRequest: {e}") from e
    cells = size = 0
    for datum in message.data:
        tokens = sum(len(chunk.encoded_text.tokens) // _TOKEN_BYTES for chunk in datum.model_input)
        cells, size = cells + tokens, size + tokens * _TOKEN_BYTES
        for tensor in datum.loss_fn_inputs.values():
            itemsize = _CELL_BYTES.get(tensor.dtype, 8)
            count = math.prod(max(0, int(s)) for s in tensor.shape) if tensor.shape else \
                len(tensor.dense) // itemsize
            cells, size = cells + count, size + count * itemsize
    return DenseSize(len(message.data), cells, size)


def encode_sample_response(sequences: Sequence[SampledSeq],
                           prompt_logprobs: Sequence[float | None] | None = None,
                           topk_prompt_logprobs: Sequence[list[tuple[int, float]] | None] | None = None, *,
                           sample_k: int = 0, prompt_k: int = 0,
                           target_prompt_logprobs: TargetLogprobs | None = None,
                           prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None,
                           prompt_cache_hit_tokens: int = 0) -> bytes:
    """A ``SampleResponse``. ``prompt_logprobs`` has one entry per prompt token, None where there is
    none (position 0). ``sample_k`` and ``prompt_k`` are the k the request asked for
    (``topk_sample_logprobs``, ``topk_prompt_logprobs``): the widths of the top-k matrices, whose
    short rows are padded with empty cells. ``prompt_alt_tokens`` is (token ids, logprobs), both
    ``[len(prompt) - 1, k]``. Sequence ids are not in the proto: the asample reply carries them."""
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
    if prompt_alt_tokens is not None:
        ids, logprobs = prompt_alt_tokens
        message.prompt_alt_tokens.CopyFrom(pb.PromptAltTokens(
            tokens=pb.Tensor(dtype=pb.DTYPE_INT64, shape=list(ids.shape),
                             dense=np.ascontiguousarray(ids, dtype="<i8").tobytes()),
            logprobs=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(logprobs.shape),
                               dense=np.ascontiguousarray(logprobs, dtype="<f4").tobytes())))
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
