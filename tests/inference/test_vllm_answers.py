"""Reading and stamping vLLM's answers (vllm_answers.py), on bodies as vLLM writes them."""

from __future__ import annotations

import json

from loopline.inference.vllm_answers import VersionStamp, error_of, usage_of, with_model

JOB = "a" * 64


def test_stamp_names_what_was_asked_and_the_version():
    stamp = VersionStamp(f"{JOB}@3", JOB, f"{JOB}@3")
    body = (b'{"id":"cmpl-1","model":"' + JOB.encode() + b'@3",'
            b'"choices":[{"text":"say \\"model\\":\\"x\\""}],"system_fingerprint":"vllm-0.32.0-abc"}')
    out = json.loads(stamp.apply(body))
    assert out["model"] == JOB and out["system_fingerprint"] == f"{JOB}@3"
    assert out["choices"][0]["text"] == 'say "model":"x"', "text inside strings is never touched"
    chunk = b'data: {"model":"' + JOB.encode() + b'@3","system_fingerprint":null}\n\n'
    assert b'"system_fingerprint":"' + JOB.encode() + b'@3"' in stamp.apply(chunk)


def test_usage_of_json_streams_and_responses():
    plain = b'{"usage":{"prompt_tokens":11,"total_tokens":15,"completion_tokens":4}}'
    assert usage_of(plain, False) == (11, 4)
    stream = (b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,'
              b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n')
    assert usage_of(stream, True) == (3, 2)
    responses = b'{"usage":{"input_tokens":5,"output_tokens":7,"input_tokens_details":{"cached_tokens":0}}}'
    assert usage_of(responses, False) == (5, 7)
    assert usage_of(b'data: {"choices":[]}\n\n', True) == (0, 0)


def test_errors_in_vllm_and_fastapi_shapes():
    vllm = (b'{"error":{"message":"stop cannot contain an empty string.","type":"BadRequestError",'
            b'"param":"stop","code":400}}')
    error = error_of(400, vllm)
    assert error is not None and (error.status, error.type, error.param) == (400, "BadRequestError", "stop")
    missing = error_of(404, b'{"detail":"Not Found"}')
    assert missing is not None and missing.message == "Not Found"
    assert error_of(200, b"{}") is None
    assert error_of(500, b"Internal Server Error").type == "server_error"


def test_with_model_keeps_a_lone_surrogate_escaped():
    body = b'{"model":"' + JOB.encode() + b'","prompt":"\\ud800abc"}'
    out = with_model(body, f"{JOB}@3")
    assert b"\\ud800abc" in out and json.loads(out)["model"] == f"{JOB}@3"
    assert with_model(b"[1,2]", "x") == b"[1,2]" and with_model(b"{not json", "x") == b"{not json"
