"""The session worker's protobuf (loopline.tinker_worker.proto), checked against the SDK itself:
requests are encoded by the SDK's ``request_conv`` (as ``AsyncTrainingResource.forward_backward``
does) and decoded into the SDK's own ``Datum``, and our results are decoded by its ``response_conv``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import deserialize_forward_backward_output

from loopline.tinker_worker.proto import (
    RequestBounds,
    decode_forward_backward,
    encode_forward_backward_output,
)
from support.tinker_data import inputs_of, sdk_body, sdk_datum as datum, tokens_of

# Far above these tests' bodies: the bounds themselves are test_request_bounds.py's.
BOUNDS = RequestBounds(1 << 30)


def test_forward_backward_request_round_trip():
    sparse = torch.zeros(6, 5)
    sparse[1, 3], sparse[4, 0] = 0.25, -2.0
    sparse_td = types.TensorData.from_torch_sparse(sparse)
    assert sparse_td.sparse_crow_indices is not None  # the SDK really sent CSR
    two_chunks = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]),
                                          types.EncodedTextChunk(tokens=[70000, 8])])
    data = [
        datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[0.0, 1.0, 0.5]),
        types.Datum(model_input=two_chunks, loss_fn_inputs={
            "target_tokens": np.array([6, 70000, 8, 9], dtype=np.int64),
            "logprobs": [-1.5, -0.25, -3.0, -0.125], "advantages": [1.0, -1.0, 0.5, 2.0],
            "mask": sparse_td}),
    ]
    body = sdk_body(data, seq_id=7, forward_only=True, loss_fn="ppo",
                    config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "variant": "token"})
    call = decode_forward_backward(body, BOUNDS)

    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("ab" * 16 + ":train:0", 7, "ppo",
                                                                              True)
    assert call.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "variant": "token"}
    assert [tokens_of(d) for d in call.data] == [[1, 2, 3], [5, 6, 70000, 8]]
    first, second = (inputs_of(d) for d in call.data)
    assert first["target_tokens"].dtype == np.int64 and first["target_tokens"].tolist() == [2, 3, 4]
    assert first["weights"].dtype == np.float32 and first["weights"].tolist() == [0.0, 1.0, 0.5]
    assert second["logprobs"].tolist() == [-1.5, -0.25, -3.0, -0.125]
    assert second["advantages"].tolist() == [1.0, -1.0, 0.5, 2.0]
    assert second["mask"].shape == (6, 5) and np.array_equal(second["mask"], sparse.numpy())
    assert second["mask"].flags.writeable  # the worker may turn it into a torch tensor in place


def test_two_d_dense_input_keeps_its_shape_and_unset_seq_id_is_none():
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    body = sdk_body([datum([1, 2, 3], weights=weights)], seq_id=None)
    call = decode_forward_backward(body, BOUNDS)
    assert call.seq_id is None and call.forward_only is False and call.loss_fn_config == {}
    assert np.array_equal(inputs_of(call.data[0])["weights"], weights)


def test_body_refusals():
    with pytest.raises(ValueError, match="not a tinker ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff\xff", BOUNDS)


def raw_request(tensor: pb.Tensor, chunk: pb.Chunk | None = None) -> bytes:
    """Bodies the SDK will not write, for the refusals."""
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = message.data.add()
    d.model_input.add().CopyFrom(chunk or pb.Chunk(encoded_text=pb.EncodedTextChunk(
        tokens=np.array([1, 2], dtype=np.int32).tobytes())))
    d.loss_fn_inputs["weights"].CopyFrom(tensor)
    return bytes(message.SerializeToString())


F32 = np.array([1.0, 2.0], dtype=np.float32).tobytes()


@pytest.mark.parametrize("tensor, error", [
    (pb.Tensor(dense=np.array([1, 2], dtype=np.int32).tobytes(), dtype=pb.DTYPE_INT32),
     r"data\[0\].loss_fn_inputs\['weights'\]: dtype DTYPE_INT32 is not accepted"),
    (pb.Tensor(dense=b"\0\0", dtype=pb.DTYPE_BFLOAT16), "dtype DTYPE_BFLOAT16"),
    (pb.Tensor(dense=F32), "dtype DTYPE_UNSPECIFIED"),
    (pb.Tensor(dense=F32 + b"\0", dtype=pb.DTYPE_FLOAT32), "not a whole number of float32"),
    (pb.Tensor(dense=F32, dtype=pb.DTYPE_FLOAT32, shape=[3]), r"2 values do not fill shape \[3\]"),
    (pb.Tensor(sparse_csr=pb.SparseCsr(values=F32, crow_indices=np.array([0, 2], dtype=np.int64).tobytes(),
                                       col_indices=np.array([0, 5], dtype=np.int64).tobytes()),
               dtype=pb.DTYPE_FLOAT32, shape=[1, 3]), "inconsistent CSR"),
    (pb.Tensor(sparse_csr=pb.SparseCsr(values=F32), dtype=pb.DTYPE_FLOAT32, shape=[2]), "2-D shape"),
    (pb.Tensor(sparse_csr=pb.SparseCsr(), dtype=pb.DTYPE_FLOAT32, shape=[1 << 20, 1 << 20]),
     "LOOPLINE_TINKER_MAX_REQUEST_BYTES"),
])
def test_tensor_refusals_name_the_field(tensor, error):
    with pytest.raises(ValueError, match=error):
        decode_forward_backward(raw_request(tensor), BOUNDS)


def _with_spans(model: list[pb.ProvenanceSpan], loss: list[pb.ProvenanceSpan]) -> bytes:
    message = pb.ForwardBackwardRequest()
    message.ParseFromString(raw_request(pb.Tensor(dense=F32, dtype=pb.DTYPE_FLOAT32, shape=[2])))
    message.data[0].model_input_spans.extend(model)
    message.data[0].loss_fn_input_spans.extend(loss)
    return bytes(message.SerializeToString())


def _sampled(sequence_id: str, length: int = 2) -> pb.ProvenanceSpan:
    return pb.ProvenanceSpan(sampled_tokens=pb.SampledProvenanceSpan(sequence_id=sequence_id, length=length))


@pytest.mark.parametrize("model, loss, error", [
    ([], [_sampled("a:0")], "provenance comes as a pair"),
    ([_sampled("a:0")], [_sampled("x" * 300)], r"loss_fn_input_spans\[0\].sequence_id is over 256"),
    ([_sampled("a:0")], [_sampled("")], r"loss_fn_input_spans\[0\]: .*must be non-empty"),
    ([_sampled("a:0")], [_sampled("a:0", length=-1)], ">= 0"),
    ([_sampled("a:0")], [pb.ProvenanceSpan()], "names neither prompt_tokens nor sampled_tokens"),
])
def test_provenance_on_the_wire_is_checked(model, loss, error):
    with pytest.raises(ValueError, match=error):
        decode_forward_backward(_with_spans(model, loss), BOUNDS)


def test_image_and_audio_chunks_are_refused():
    image = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1]),
                                     types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)])
    body = sdk_body([types.Datum(model_input=image, loss_fn_inputs={"weights": [1.0] * 5})])
    with pytest.raises(ValueError, match="image inputs are not supported by this server"):
        decode_forward_backward(body, BOUNDS)
    dmel = pb.Chunk(dmel=pb.DmelChunk(dmel=b"x"))
    with pytest.raises(ValueError, match=r"data\[0\]: dmel chunks: image inputs are not supported"):
        decode_forward_backward(raw_request(pb.Tensor(dense=F32, dtype=pb.DTYPE_FLOAT32), dmel), BOUNDS)


def test_forward_backward_output_through_the_sdk_decoder():
    outputs = [
        {"logprobs": np.array([-1.0, -2.5, -0.125]), "elementwise_loss": np.array([1.0, 2.5, 0.125]),
         "argmax": np.array([3, 4, 5], dtype=np.int32)},
        {"logprobs": np.array([-4.0], dtype=np.float32), "elementwise_loss": np.array([4.0]),
         "argmax": np.array([9])},
    ]
    body = encode_forward_backward_output("ArrayRecord", outputs, {"loss:sum": 7.75, "tokens:sum": 4})
    result = deserialize_forward_backward_output(body)
    assert result.loss_fn_output_type == "ArrayRecord"
    assert result.metrics == {"loss:sum": 7.75, "tokens:sum": 4.0}
    assert [o["logprobs"].tolist() for o in result.loss_fn_outputs] == [[-1.0, -2.5, -0.125], [-4.0]]
    assert [o["elementwise_loss"].dtype for o in result.loss_fn_outputs] == ["float32", "float32"]
    assert [o["argmax"].tolist() for o in result.loss_fn_outputs] == [[3, 4, 5], [9]]
    assert result.loss_fn_outputs[0]["argmax"].dtype == "int64"
    assert result.loss_fn_outputs[1]["logprobs"].shape == [1]


def test_outputs_that_differ_in_trailing_shape_go_in_separate_records():
    top2 = np.array([[-0.5, -1.0], [-0.25, -2.0]])
    top3 = np.array([[-0.5, -1.0, -3.0]])
    outputs = [{"top": top2}, {"top": top2[:1]}, {"top": top3}, {"top": np.float64(-1.5).reshape(())}]
    body = encode_forward_backward_output("ArrayRecord", outputs, {})
    message = pb.ForwardBackwardOutput.FromString(body)
    assert [r.num_datums for r in message.loss_fn_outputs] == [2, 1, 1]
    decoded = [o["top"] for o in deserialize_forward_backward_output(body).loss_fn_outputs]
    assert [t.shape for t in decoded] == [[2, 2], [1, 2], [1, 3], [1]]
    assert decoded[0].tolist() == top2.tolist() and decoded[2].tolist() == top3.tolist()
    assert decoded[3].tolist() == [-1.5]


def test_empty_output_and_output_refusals():
    empty = deserialize_forward_backward_output(
        encode_forward_backward_output("ArrayRecord", [], {"loss:sum": 0}))
    assert empty.loss_fn_outputs == [] and empty.metrics == {"loss:sum": 0.0}
    for key in ("loss", "loss:sum:x"):
        with pytest.raises(ValueError, match="is not name:reduction"):
            encode_forward_backward_output("ArrayRecord", [], {key: 1.0})
    with pytest.raises(ValueError, match=r"outputs\[1\] has fields"):
        encode_forward_backward_output("ArrayRecord", [{"logprobs": np.zeros(2)}, {"loss": np.zeros(2)}], {})
    with pytest.raises(ValueError, match="neither float nor int"):
        encode_forward_backward_output("ArrayRecord", [{"mask": np.array([True])}], {})
