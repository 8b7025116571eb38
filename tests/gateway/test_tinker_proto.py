"""The gateway's tinker protobuf (loopline.gateway.tinker.proto), checked against the SDK itself:
forward_backward bodies as the SDK's ``request_conv`` encodes them (as
``AsyncTrainingResource.forward_backward`` does), of which the gateway undoes the zstd and reads the
routing fields, and sample responses our encoder writes and the SDK's ``response_conv`` decodes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import deserialize_sample_response

from loopline.gateway.tinker.proto import (
    SampledSeq,
    TargetLogprobs,
    encode_sample_response,
    request_body,
    route_of,
)
from support.tinker_data import sdk_body, sdk_datum as datum


def test_routing_fields_are_read_and_the_datums_left_to_the_worker():
    body = sdk_body([datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[0.0, 1.0, 0.5])], seq_id=7)
    assert route_of(body) == ("ab" * 16 + ":train:0", 7)
    assert route_of(sdk_body([datum([1], weights=[1.0])], seq_id=None))[1] is None


def test_zstd_bodies_as_the_sdk_sends_them():
    body = sdk_body([datum(list(range(500)), target_tokens=list(range(1, 501)), weights=[1.0] * 500)])
    # training.py: zstd.ZstdCompressor().compress(body) with Content-Encoding: zstd
    compressed = zstandard.ZstdCompressor().compress(body)
    assert len(compressed) < len(body)
    assert request_body(compressed, "zstd") == body == request_body(body, None)
    assert request_body(compressed, " ZSTD ") == body
    # A frame that does not declare its size (another client's streaming compressor) also decodes.
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(body)
    assert route_of(request_body(streamed, "zstd")) == route_of(body) == ("ab" * 16 + ":train:0", 7)


def test_body_refusals():
    body = sdk_body([datum([1, 2], weights=[1.0, 1.0])])
    with pytest.raises(ValueError, match="gzip"):
        request_body(body, "gzip")
    with pytest.raises(ValueError, match="not valid zstd"):
        request_body(b"not zstd at all", "zstd")
    bomb = zstandard.ZstdCompressor().compress(bytes(10 << 20))
    with pytest.raises(ValueError, match="more than 1048576 bytes"):
        request_body(bomb, "zstd", max_bytes=1 << 20)
    with pytest.raises(ValueError, match="not a tinker ForwardBackwardRequest"):
        route_of(b"\xff\xff\xff\xff")
    with pytest.raises(ValueError, match="no model_id"):
        route_of(pb.ForwardBackwardRequest(seq_id=1).SerializeToString())


def test_sample_response_through_the_sdk_decoder():
    sequences = [
        SampledSeq(tokens=[11, 12, 2], stop_reason="stop", logprobs=[-0.5, -1.25, -0.0625],
                   topk=[[(11, -0.5), (40, -1.5)], [(13, -1.0), (12, -1.25)], [(2, -0.0625)]]),
        SampledSeq(tokens=[14, 15], stop_reason="length", logprobs=[-2.0, -3.0], topk=[None, [(15, -3.0)]]),
    ]
    body = encode_sample_response(
        sequences, prompt_logprobs=[None, -4.5, -0.75],
        topk_prompt_logprobs=[None, [(7, -0.5), (8, -1.0)], [(9, -0.75), (10, -0.8)]], sample_k=2, prompt_k=3,
        prompt_cache_hit_tokens=3)
    response = deserialize_sample_response(body)
    first, second = response.sequences
    assert (first.stop_reason, first.tokens, first.logprobs) == ("stop", [11, 12, 2], [-0.5, -1.25, -0.0625])
    assert first.tokens_np.dtype == np.int32 and first.logprobs_np.dtype == np.float32
    assert first.topk_logprobs == [[(11, -0.5), (40, -1.5)], [(13, -1.0), (12, -1.25)], [(2, -0.0625)]]
    assert (second.stop_reason, second.tokens, second.logprobs) == ("length", [14, 15], [-2.0, -3.0])
    assert second.topk_logprobs == [None, [(15, -3.0)]]
    assert response.prompt_logprobs == [None, -4.5, -0.75]
    assert math.isnan(response.prompt_logprobs_np[0])
    assert response.topk_prompt_logprobs == [None, [(7, -0.5), (8, -1.0)],
                                             [(9, -0.75), (10, float(np.float32(-0.8)))]]
    assert response.topk_prompt_logprobs_np.token_ids.shape == (3, 3)  # k=3 asked, 2 answered: padded
    assert first.topk_logprobs_np.logprobs.shape == (3, 2)
    assert response.prompt_cache_hit_tokens == 3 and response.target_prompt_logprobs is None


def test_sample_response_leaves_out_what_was_not_asked():
    response = deserialize_sample_response(encode_sample_response([SampledSeq([5], "length")]))
    seq = response.sequences[0]
    assert seq.tokens == [5] and seq.logprobs is None and seq.topk_logprobs is None
    assert response.prompt_logprobs is None and response.topk_prompt_logprobs is None
    # The SDK reads empty bytes as "not sent": a 0-token sequence has no logprobs, whatever we send.
    empty = deserialize_sample_response(encode_sample_response([SampledSeq([], "stop", logprobs=[])]))
    assert empty.sequences[0].tokens == [] and empty.sequences[0].logprobs is None


def test_target_prompt_logprobs_dense_and_sparse():
    dense = TargetLogprobs(values=np.array([[-1.0, 0.0], [-2.0, -3.0]]), shape=[2, 2])
    sparse = TargetLogprobs(values=np.array([-2.5]), shape=[2, 3], crow_indices=[0, 0, 1], col_indices=[2])
    expected_dense, expected_sparse = [[-1.0, 0.0], [-2.0, -3.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, -2.5]]
    for target, expected in ((dense, expected_dense), (sparse, expected_sparse)):
        got = deserialize_sample_response(encode_sample_response([], target_prompt_logprobs=target))
        assert got.target_prompt_logprobs is not None and got.target_prompt_logprobs.dtype == "float32"
        assert got.target_prompt_logprobs.to_numpy().tolist() == expected


def test_sample_response_refusals():
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        encode_sample_response([SampledSeq([1, 2], "stop", logprobs=[-1.0])])
    with pytest.raises(ValueError, match="1 top-k rows for 2 tokens"):
        encode_sample_response([SampledSeq([1, 2], "stop", topk=[None])], sample_k=1)
    with pytest.raises(ValueError, match="k >= 1"):
        encode_sample_response([], topk_prompt_logprobs=[None])
