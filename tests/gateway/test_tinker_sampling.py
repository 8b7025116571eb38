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

from loopline.gateway.tinker import prompt_scoring
from loopline.gateway.tinker.sampling import TinkerUserError, completion_body, prefix_bodies, sample_response

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.stem.removeprefix("vllm_") for p in FIXTURES.glob("vllm_*.json"))


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"vllm_{name}.json").read_text())


def decoded(name: str) -> tuple[tt.SampleResponse, dict[str, Any]]:
    """The fixture's vLLM answer as the SDK reads our SampleResponse, and the fixture."""
    f = fixture(name)
    request = tt.SampleRequest.model_validate_json(json.dumps(f["request"]))  # as the route parses it
    answer = sample_response(f["response"], request, f.get("prefix_responses", []))
    return deserialize_sample_response(answer), f


def f32(values: list[float]) -> list[float]:
    return np.asarray(values, dtype=np.float32).tolist()


def test_the_fixtures_are_what_completion_body_asks_for():
    assert len(CASES) == 10
    for name in CASES:
        f = fixture(name)
        assert completion_body(f["request"], "tiny") | f["extra"] == f["body"], name
        assert prefix_bodies(f["request"], "tiny") == f.get("prefix_bodies", []), name


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


# --- target_prompt_logprobs and prompt_alt_tokens_k (prompt_scoring.py) ------------------------------

def _own_token_logprobs(f: dict[str, Any]) -> dict[tuple[int, int], float]:
    """(row, id) -> logprob from vLLM's prompt-logprob path of the main answer: row i scores the
    prompt's own token at position i + 1. Another code path than the prefix requests'."""
    entries = f["response"]["choices"][0]["prompt_logprobs"]
    return {(i - 1, int(t)): v["logprob"]
            for i, entry in enumerate(entries) if entry for t, v in entry.items()}


def test_sparse_target_logprobs_keep_the_request_layout_and_equal_prompt_logprobs():
    """The cookbook's decisions recipe sends a sparse CSR tensor with -1 elsewhere and reads it back
    with to_torch(); each listed cell is the exact logprob of its id at its row's position."""
    response, f = decoded("target_sparse")
    asked = f["request"]["target_prompt_logprobs"]
    target = response.target_prompt_logprobs
    assert target is not None and target.dtype == "float32" and target.shape == asked["shape"]
    assert target.sparse_crow_indices == asked["sparse_crow_indices"]
    assert target.sparse_col_indices == asked["sparse_col_indices"]
    dense = target.to_torch()
    assert dense.shape == (3, 3) and dense[0].abs().sum() == 0  # row 0 named nothing
    prefix = f["prefix_responses"][0]["choices"]  # one prefix per row that names an id: rows 1, 2
    for (row, col), token in zip([(1, 1), (2, 0), (2, 1), (2, 2)], asked["data"], strict=True):
        expected = prefix[row - 1]["logprobs"]["top_logprobs"][0][f"token_id:{token}"]
        assert dense[row, col].item() == pytest.approx(expected, abs=1e-6)
    # The union of ids is scored at every prefix: where one is the prompt's own token, the value is
    # vLLM's prompt logprob of it (row 2 scores position 3, " fox" = 676).
    own = _own_token_logprobs(f)
    assert prefix[1]["logprobs"]["top_logprobs"][0]["token_id:676"] == pytest.approx(own[(2, 676)], abs=1e-5)


def test_dense_targets_and_alt_tokens_in_one_request():
    response, f = decoded("target_dense_alt")
    target = response.target_prompt_logprobs
    assert target is not None and target.sparse_crow_indices is None and target.shape == [3, 2]
    values = target.to_numpy()
    own = _own_token_logprobs(f)
    assert values[0, 0] == pytest.approx(own[(0, 700)], abs=1e-5)  # " quick" after "The"
    assert values[0, 1] == values[1, 0] == values[1, 1] == 0.0  # -1: no logprob
    assert values[2, 0] < 0 and values[2, 1] < 0
    alt = response.prompt_alt_tokens
    assert alt is not None
    tokens, logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert alt.tokens.dtype == "int64" and tokens.shape == logprobs.shape == (3, 3)
    choices = f["prefix_responses"][1]["choices"]  # prefix i's k draws are choices i*k .. i*k + k - 1
    for i, choice in enumerate(choices):
        row, j = divmod(i, 3)
        assert f"token_id:{tokens[row, j]}" == choice["logprobs"]["tokens"][0]
        assert logprobs[row, j] == pytest.approx(choice["logprobs"]["token_logprobs"][0], abs=1e-6)
    # The SDK's check that a server answered the draws it was asked for.
    from tinker.lib.public_interfaces.sampling_client import _check_prompt_alt_tokens_returned
    _check_prompt_alt_tokens_returned(response, 3)


def test_greedy_alt_tokens_repeat_the_argmax():
    request = sdk_request(prompt=tt.ModelInput.from_ints([5, 6, 7]), prompt_alt_tokens_k=4,
                          sampling_params=tt.SamplingParams(max_tokens=1, temperature=0.0))
    [body] = prefix_bodies(request, "m")
    assert body["n"] == 1 and body["prompt"] == [[5], [5, 6]] and body["temperature"] == 0.0
    draw = {"logprobs": {"tokens": ["token_id:9"], "top_logprobs": [{"token_id:9": -0.5}]}}
    answer = {"choices": [{"index": i, **draw} for i in range(2)]}
    ids, logprobs = prompt_scoring.alt_tokens(answer, request, 3)
    assert ids.tolist() == [[9] * 4] * 2 and logprobs.tolist() == [[-0.5] * 4] * 2


def _target(data: list[int], shape: list[int], **sparse: list[int]) -> dict[str, Any]:
    return {"target_prompt_logprobs": {"data": data, "dtype": "int64", "shape": shape, **sparse}}


@pytest.mark.parametrize("fields, error", [
    ({"target_prompt_logprobs": {"data": [1.0, 2.0], "dtype": "float32", "shape": [2, 1]}}, "int64"),
    (_target([3, 4, 5], [3, 1]), r"shape \[len\(prompt\) - 1, K\] = \[2, K\]"),
    (_target([3, 4], [2]), r"= \[2, K\] with K >= 1, not \[2\]"),
    (_target([3, 4, 5], [2, 2]), "3 values do not fill shape"),
    (_target([-1, -1], [2, 1]), "names no token id"),
    (_target([3, -2], [2, 1]), "-1 for none; not -2"),
    (_target([3], [2, 4], sparse_crow_indices=[0, 1], sparse_col_indices=[0]), "CSR indices"),
    (_target([3], [2, 4], sparse_crow_indices=[0, 0, 1], sparse_col_indices=[4]), "CSR indices"),
    (_target([3, 4], [2, 4], sparse_crow_indices=[0, 2, 1], sparse_col_indices=[0, 1]), "CSR indices"),
    (_target(list(range(40)), [2, 20]), "40 distinct ids; .* at most 32 \\(MAX_TARGET_IDS\\)"),
    ({"prompt_alt_tokens_k": 300}, "asks for 600 draws; .* at most 512 \\(MAX_PROMPT_PREFIXES\\)"),
    ({"prompt_alt_tokens_k": 1, "prompt": tt.ModelInput.from_ints([5])}, "2 tokens or more"),
])
def test_bad_targets_and_alt_tokens_are_refused_naming_them(fields, error):
    with pytest.raises(TinkerUserError, match=error):
        completion_body(sdk_request(**fields), "m")


def test_target_rows_are_bounded():
    prompt = tt.ModelInput.from_ints(list(range(1, 602)))
    fields = _target([7] * 600, [600, 1])
    with pytest.raises(TinkerUserError, match=r"ids in 600 rows; .* at most 512"):
        completion_body(sdk_request(prompt=prompt, **fields), "m")


def test_prefix_answers_that_were_not_asked_for_are_errors():
    f = fixture("target_sparse")
    with pytest.raises(ValueError, match="0 answers to the prompt-prefix requests"):
        sample_response(f["response"], f["request"], [])
    short = {"choices": f["prefix_responses"][0]["choices"][:1]}
    with pytest.raises(ValueError, match="answered 1 choices to the prompt-prefix request, not 2"):
        sample_response(f["response"], f["request"], [short])
    choices = f["prefix_responses"][0]["choices"]
    unscored = [choices[0], {**choices[1], "logprobs": {"tokens": ["token_id:1"],
                                                         "top_logprobs": [{"token_id:1": -1.0}]}}]
    with pytest.raises(ValueError, match="did not score token 5 at prompt position 3"):
        sample_response(f["response"], f["request"], [{"choices": unscored}])


def test_a_sparse_tensor_is_never_densified():
    """A sparse tensor may claim any width: only its listed cells are read, and answered."""
    fields = _target([7, 8], [2, 10**12], sparse_crow_indices=[0, 1, 2], sparse_col_indices=[5, 10**12 - 1])
    request = sdk_request(**fields)
    [body] = prefix_bodies(request, "m")
    assert body["prompt"] == [[5], [5, 6]] and body["logprob_token_ids"] == [7, 8]
    cells = prompt_scoring.target_cells(request, 3)
    assert cells is not None
    tops = [{"token_id:7": -1.0, "token_id:8": -2.0}, {"token_id:8": -3.0, "token_id:7": -4.0}]
    answer = {"choices": [{"index": i, "logprobs": {"tokens": ["token_id:1"], "top_logprobs": [top]}}
                          for i, top in enumerate(tops)]}
    target = prompt_scoring.target_logprobs(answer, cells).to_proto()
    assert list(target.shape) == [2, 10**12]
    assert np.frombuffer(target.sparse_csr.values, "<f4").tolist() == [-1.0, -3.0]
