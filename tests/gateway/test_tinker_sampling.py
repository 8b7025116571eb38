"""Tinker sampling through vLLM (loopline.gateway.tinker.sampling): the completion request a
SampleRequest becomes, and vLLM's answer as the SampleResponse the SDK decodes. The answers are vLLM
0.32's real ones on the tiny model (fixtures/capture_vllm_completions.py records them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tinker import types as tt
from tinker.lib.public_interfaces.sampling_client import _check_prompt_logprobs_last_n_honored
from tinker.proto.response_conv import deserialize_sample_response

from loopline.gateway.tinker.sampling import TinkerUserError, completion_body, sample_response

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.stem.removeprefix("vllm_") for p in FIXTURES.glob("vllm_*.json"))


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"vllm_{name}.json").read_text())


def decoded(name: str) -> tuple[tt.SampleResponse, dict[str, Any]]:
    """The fixture's vLLM answer as the SDK reads our SampleResponse, and the fixture."""
    f = fixture(name)
    request = tt.SampleRequest.model_validate_json(json.dumps(f["request"]))  # as the route parses it
    return deserialize_sample_response(sample_response(f["response"], request)), f


def f32(values: list[float]) -> list[float]:
    return np.asarray(values, dtype=np.float32).tolist()


def test_the_fixtures_are_what_completion_body_asks_for():
    assert len(CASES) == 8
    for name in CASES:
        f = fixture(name)
        assert completion_body(f["request"], "tiny") | f["extra"] == f["body"], name


@pytest.mark.parametrize("name", CASES)
def test_every_answer_passes_tokens_logprobs_and_stop_reason_through(name):
    response, f = decoded(name)
    choices = f["response"]["choices"]
    assert len(response.sequences) == len(choices) == f["request"].get("num_samples", 1)
    for seq, choice in zip(response.sequences, choices, strict=True):
        assert seq.tokens == choice["token_ids"] and len(seq.tokens) > 0
        assert seq.logprobs == f32(choice["logprobs"]["token_logprobs"])
        assert seq.stop_reason == choice["finish_reason"]
        assert seq.topk_logprobs is None or f["request"].get("topk_sample_logprobs")


def test_a_stop_token_or_string_is_the_end_of_the_tokens():
    """Tinker's convention: the stop sequence's tokens are in ``tokens``; vLLM keeps them."""
    expectations = {  # name: stop_reason, tokens, what vLLM says stopped it
        "stop_token": ("stop", [326, 161, 515], 515),  # stop=[515]: the stop token is the last token
        "stop_string": ("stop", [326, 161, 515], " has"),  # " has" is 515: kept, though the text drops it
        "stop_string_mid_token": ("stop", [326, 161, 515, 605, 622], "];i"),  # "];i" ends inside 622 "ien"
        "eos": ("stop", [2], None),  # stop=None: EOS stops, and is the last token
        "no_stops": ("length", [2, 2, 2], None),  # stop=[]: not even EOS stops it
    }
    for name, (reason, tokens, matched) in expectations.items():
        response, f = decoded(name)
        assert (response.sequences[0].stop_reason, response.sequences[0].tokens) == (reason, tokens), name
        choice = f["response"]["choices"][0]
        assert choice["stop_reason"] == matched, name
        if isinstance(matched, str):
            assert matched not in choice["text"], name  # only the text leaves the stop string out


def test_seeded_samples_differ():
    response, f = decoded("two_samples_seeded")
    assert f["body"]["seed"] == 7 and f["body"]["n"] == 2
    assert response.sequences[0].tokens != response.sequences[1].tokens  # vLLM seeds sample i with 7 + i


def test_top_k_sample_and_prompt_logprobs():
    response, f = decoded("topk")
    choice = f["response"]["choices"][0]
    # The first sampled token (410, -5.98) is outside the top 3: vLLM lists it first, then the top 3.
    assert choice["logprobs"]["top_logprobs"][0]["token_id:410"] == pytest.approx(-5.9814, abs=1e-4)
    first_row = response.sequences[0].topk_logprobs[0]
    assert [t for t, _ in first_row] == [326, 413, 810]
    assert [lp for _, lp in first_row] == f32([-1.5713589191436768, -2.1137912273406982, -3.79256272315979])
    for seq_row, token, lp in zip(response.sequences[0].topk_logprobs, response.sequences[0].tokens,
                                  response.sequences[0].logprobs, strict=True):
        assert len(seq_row) == 3 and [x[1] for x in seq_row] == sorted((x[1] for x in seq_row), reverse=True)
        assert token in [t for t, _ in seq_row] or lp <= seq_row[-1][1]
    prompt = f["request"]["prompt"]["chunks"][0]["tokens"]
    entries = choice["prompt_logprobs"]
    own = [entries[i][str(prompt[i])]["logprob"] for i in (1, 2, 3)]  # each prompt token's own
    assert response.prompt_logprobs == [None, *f32(own)]
    assert response.topk_prompt_logprobs[0] is None
    top2 = [[t for t, _ in row] for row in response.topk_prompt_logprobs[1:]]
    assert top2 == [[3, 326], [3, 853], [504, 550]]  # by rank; the prompt's own tokens rank 64, 823, 625
    assert response.topk_prompt_logprobs_np.token_ids.shape == (4, 2)  # each matrix is as wide as its k
    assert response.sequences[0].topk_logprobs_np.token_ids.shape == (4, 3)


def test_compute_logprobs_honours_last_n_as_the_sdk_checks_it():
    response, f = decoded("compute_logprobs")
    full = f["response"]["choices"][0]["prompt_logprobs"]
    assert full[1] is not None  # vLLM scored the whole prompt; only the last 2 are answered
    last_two = f32([full[2]["727"]["logprob"], full[3]["676"]["logprob"]])
    assert response.prompt_logprobs == [None, None, *last_two]
    _check_prompt_logprobs_last_n_honored(response, 2)  # the SDK's own check raises otherwise
    assert response.topk_prompt_logprobs is None and response.sequences[0].topk_logprobs is None


def sdk_request(**fields: Any) -> tt.SampleRequest:
    """A SampleRequest as the gateway gets it: the SDK's JSON, parsed back."""
    fields.setdefault("prompt", tt.ModelInput.from_ints([5, 6, 7]))
    fields.setdefault("sampling_params", tt.SamplingParams(max_tokens=9))
    sent = tt.SampleRequest(**fields).model_dump_json(exclude_none=True)
    return tt.SampleRequest.model_validate_json(sent)


@pytest.mark.parametrize("stop, expected", [
    (None, {}),
    ([], {"ignore_eos": True}),
    ("\n\n", {"stop": ["\n\n"]}),
    (["User:", "<|im_end|>"], {"stop": ["User:", "<|im_end|>"]}),
    ([2, 17], {"stop_token_ids": [2, 17]}),
])
def test_stop_forms(stop, expected):
    body = completion_body(sdk_request(sampling_params=tt.SamplingParams(max_tokens=4, stop=stop)), "m")
    assert {k: body[k] for k in ("stop", "stop_token_ids", "ignore_eos") if k in body} == expected


def test_completion_body_fields():
    params = tt.SamplingParams(max_tokens=9, seed=11, temperature=0.5, top_k=40, top_p=0.9)
    body = completion_body(sdk_request(num_samples=3, sampling_params=params, topk_sample_logprobs=4,
                                       topk_prompt_logprobs=2), "adapter-hash")
    assert body == {"model": "adapter-hash", "prompt": [5, 6, 7], "n": 3, "max_tokens": 9, "seed": 11,
                    "temperature": 0.5, "top_k": 40, "top_p": 0.9, "logprobs": 4, "prompt_logprobs": 2,
                    "return_token_ids": True, "return_tokens_as_token_ids": True,
                    "skip_special_tokens": False, "spaces_between_special_tokens": False}
    two_chunks = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1]), tt.EncodedTextChunk(tokens=[2, 3])])
    plain = completion_body(sdk_request(prompt=two_chunks, sampling_params=tt.SamplingParams()), "m")
    assert plain["prompt"] == [1, 2, 3] and plain["logprobs"] == 0 and plain["top_k"] == -1
    assert "max_tokens" not in plain and "seed" not in plain and "prompt_logprobs" not in plain
    assert completion_body(sdk_request(prompt_logprobs=True), "m")["prompt_logprobs"] == 0


def test_record_stability_info_samples_as_usual():
    # What it asks for is kept beside the future when the answer is made (tinker/stability.py).
    params = tt.SamplingParams(max_tokens=4)
    assert (completion_body(sdk_request(sampling_params=params, record_stability_info=True), "m")
            == completion_body(sdk_request(sampling_params=params), "m"))


@pytest.mark.parametrize("fields, error", [
    ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k is not supported"),
    ({"target_prompt_logprobs": {"data": [3, -1], "dtype": "int64", "shape": [2, 1]}},
     "target_prompt_logprobs is not supported"),
    ({"prompt_logprobs_last_n": 1}, "set prompt_logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, r"between 1 and len\(prompt\) - 1 = 2"),
    ({"prompt": tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1]),
                                      tt.ImageChunk(data=b"x", format="png")])},
     "image inputs are not supported"),
    ({"prompt": tt.ModelInput(chunks=[])}, "no tokens"),
    ({"sampling_params": tt.SamplingParams(stop=["ok", ""])}, "empty stop string"),
])
def test_what_cannot_be_honoured_is_refused(fields, error):
    with pytest.raises(TinkerUserError, match=error):
        completion_body(sdk_request(**fields), "m")


def test_a_request_that_is_not_a_sample_request_is_a_user_error():
    with pytest.raises(TinkerUserError, match="not a SampleRequest"):
        completion_body({"prompt": "hello"}, "m")


def test_answers_completion_body_did_not_ask_for_are_errors():
    f = fixture("two_samples_seeded")
    request, answer = f["request"], f["response"]
    with pytest.raises(ValueError, match="1 choices for num_samples=2"):
        sample_response({**answer, "choices": answer["choices"][:1]}, request)
    aborted = [{**answer["choices"][0], "finish_reason": "abort"}, answer["choices"][1]]
    with pytest.raises(ValueError, match="did not finish normally: finish_reason 'abort'"):
        sample_response({**answer, "choices": aborted}, request)
    no_ids = [{**answer["choices"][0], "token_ids": None}, answer["choices"][1]]
    with pytest.raises(ValueError, match="no token_ids"):
        sample_response({**answer, "choices": no_ids}, request)
    prompt = fixture("compute_logprobs")
    with pytest.raises(ValueError, match="prompt logprobs for 4 prompt tokens"):
        sample_response({**prompt["response"], "choices": [{**prompt["response"]["choices"][0],
                                                            "prompt_logprobs": None}]}, prompt["request"])
