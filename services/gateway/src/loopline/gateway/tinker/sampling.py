"""A Tinker ``SampleRequest`` as vLLM's ``/v1/completions`` request, and vLLM's answer as the SDK's
protobuf ``SampleResponse``. Pure functions: the routes (sampling_api.py) queue the body and
store the answer.

What vLLM 0.32 does, measured on the tiny model (the fixtures in tests/gateway/fixtures are its real
answers):
- ``token_ids`` keep the tokens of a matched stop: a stop token id (EOS included) is the last token,
  and with a stop string the tokens run up to and including the one that completes it (the *text*
  drops the string; we ignore the text). That is Tinker's convention, so tokens pass through as is.
- Sampled logprobs are Tinker's: of the distribution each token was drawn from, after temperature,
  top-k and top-p (the replicas run vLLM with ``--logprobs-mode processed_logprobs``, vllm_args.py;
  at temperature 0, the model's own). With ``return_tokens_as_token_ids`` every top-logprob key is
  ``token_id:N``, so no token is lost to decoding. Each ``top_logprobs`` dict holds the sampled
  token first, then the top k (k + 1 entries when the sampled token is not among them).
- ``prompt_logprobs`` (one per prompt token, None at position 0) map token ids to
  ``{logprob, rank, decoded_token}``, the prompt's own token first, then the top k.
- -inf logprobs come back as -9999.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinker import types as tt

from loopline.gateway.tinker import prompt_scoring
from loopline.gateway.tinker.proto import SampledSeq, StopReason, encode_sample_response

_FINISH_REASONS: dict[str, StopReason] = {"stop": "stop", "length": "length"}
TOKEN_ID_PREFIX = "token_id:"


class TinkerUserError(ValueError):
    """A sampling request this server cannot honour as asked: answered with a 400, so the SDK fails
    at once instead of retrying. Never dropped silently: a field we cannot honour is refused."""


def _request(req: tt.SampleRequest | dict[str, Any]) -> tt.SampleRequest:
    if isinstance(req, tt.SampleRequest):
        return req
    try:
        return tt.SampleRequest.model_validate(req)
    except ValueError as e:
        raise TinkerUserError(f"not a SampleRequest: {e}") from None


def prompt_tokens(req: tt.SampleRequest) -> list[int]:
    """The prompt's token ids; only text chunks can be sampled here."""
    tokens: list[int] = []
    for chunk in req.prompt.chunks:
        if not isinstance(chunk, tt.EncodedTextChunk):
            raise TinkerUserError(f"{chunk.type} chunks: image inputs are not supported by this server; "
                                  "send encoded_text chunks only")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise TinkerUserError("the prompt has no tokens")
    return tokens


def _refuse_unsupported(req: tt.SampleRequest, n_prompt: int) -> None:
    try:  # answered by a second vLLM request (prompt_scoring.py)
        prompt_scoring.target_cells(req, n_prompt)
        prompt_scoring.check_alt_tokens(req, n_prompt)
    except prompt_scoring.PromptScoringError as e:
        raise TinkerUserError(str(e)) from None
    if req.topk_prompt_logprobs < 0 or req.topk_sample_logprobs < 0:
        raise TinkerUserError("topk_prompt_logprobs and topk_sample_logprobs must be 0 or more")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not (req.prompt_logprobs or req.topk_prompt_logprobs):
            raise TinkerUserError("prompt_logprobs_last_n applies to prompt logprobs: set prompt_logprobs")
        if not 1 <= last_n <= n_prompt - 1:
            raise TinkerUserError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = "
                                  f"{n_prompt - 1}, not {last_n}")


def completion_body(req: tt.SampleRequest | dict[str, Any], served_model: str) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` request that samples ``req`` from ``served_model``."""
    req = _request(req)
    tokens = prompt_tokens(req)
    _refuse_unsupported(req, len(tokens))
    params = req.sampling_params
    body: dict[str, Any] = {
        "model": served_model, "prompt": tokens, "n": _vllm_n(req),
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        # 0 still returns the sampled tokens' logprobs, which Tinker always answers with.
        "logprobs": req.topk_sample_logprobs,
        "return_token_ids": True, "return_tokens_as_token_ids": True,
        # Stop strings are matched against the decoded text: keep special tokens in it, unspaced,
        # so that a stop string naming one matches (measured: stop=["<|im_end|>"] stops at that
        # token with these, and never matches with vLLM's default skip_special_tokens=true).
        "skip_special_tokens": False, "spaces_between_special_tokens": False,
    }
    if params.max_tokens is not None:  # else vLLM's default, 16 tokens
        body["max_tokens"] = params.max_tokens
    if params.seed is not None:
        body["seed"] = params.seed  # vLLM gives sample i the seed + i
    body.update(_stop(params.stop))
    if req.prompt_logprobs or req.topk_prompt_logprobs:
        body["prompt_logprobs"] = req.topk_prompt_logprobs  # 0: each prompt token's own only
    return body


def prefix_bodies(req: tt.SampleRequest | dict[str, Any], served_model: str) -> list[dict[str, Any]]:
    """The vLLM requests that answer the request's ``target_prompt_logprobs`` and
    ``prompt_alt_tokens_k``, in that order, each where asked (prompt_scoring.py): queued beside
    ``completion_body``'s, their answers go to ``sample_response`` in the same order."""
    req = _request(req)
    tokens = prompt_tokens(req)
    _refuse_unsupported(req, len(tokens))
    bodies = []
    cells = prompt_scoring.target_cells(req, len(tokens))
    if cells is not None:
        bodies.append(prompt_scoring.target_body(cells, tokens, served_model))
    if req.prompt_alt_tokens_k:
        bodies.append(prompt_scoring.alt_body(req, tokens, served_model))
    return bodies


def prefix_count(req: tt.SampleRequest) -> int:
    """How many requests ``prefix_bodies`` makes for ``req``."""
    return (req.target_prompt_logprobs is not None) + bool(req.prompt_alt_tokens_k)


def _vllm_n(req: tt.SampleRequest) -> int:
    """How many samples vLLM is asked for. Greedy sampling (temperature 0) gives every sample the
    same tokens, and vLLM refuses n > 1 with it ("n must be 1 when using greedy sampling"), while
    Tinker's quick start asks for 8: one is sampled, and the answer repeats it."""
    return 1 if req.sampling_params.temperature == 0 else req.num_samples


def _stop(stop: str | Sequence[str] | Sequence[int] | None) -> dict[str, Any]:
    """Tinker's ``stop``: None keeps the implicit EOS; [] disables every stop, EOS included; strings
    or token ids stop as well as EOS (vLLM's stop_token_ids add to it)."""
    if stop is None:
        return {}
    values = [stop] if isinstance(stop, str) else list(stop)
    if not values:
        return {"ignore_eos": True}
    if all(isinstance(v, str) for v in values):
        if "" in values:
            raise TinkerUserError("an empty stop string would match everywhere")
        return {"stop": values}
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return {"stop_token_ids": values}
    raise TinkerUserError(f"stop must be strings or token ids, not a mix: {values!r}")


def sample_response(vllm_json: dict[str, Any], req: tt.SampleRequest | dict[str, Any],
                    prefix_answers: Sequence[dict[str, Any]] = ()) -> bytes:
    """vLLM's answer to ``completion_body(req, ...)``, and ``prefix_answers`` to ``prefix_bodies``,
    as the SDK's SampleResponse bytes. Sequence ids are not in it: the asample reply carries them.
    A ValueError means vLLM answered something the bodies did not ask for."""
    req = _request(req)
    tokens = prompt_tokens(req)
    choices = sorted(vllm_json.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != _vllm_n(req):
        raise ValueError(f"vLLM answered {len(choices)} choices for num_samples={req.num_samples}")
    choices = choices * (req.num_samples // len(choices))  # greedy: the one sample, num_samples times
    k_sample = req.topk_sample_logprobs
    sequences = [_sequence(choice, k_sample) for choice in choices]

    prompt_logprobs: list[float | None] | None = None
    topk_prompt: list[list[tuple[int, float]] | None] | None = None
    if req.prompt_logprobs or req.topk_prompt_logprobs:
        entries = choices[0].get("prompt_logprobs") if choices else None
        if entries is None or len(entries) != len(tokens):
            raise ValueError(f"vLLM answered {None if entries is None else len(entries)} prompt logprobs "
                             f"for {len(tokens)} prompt tokens")
        # Scored positions: all but the first, or the last n where the request asked for fewer.
        first = len(tokens) - req.prompt_logprobs_last_n if req.prompt_logprobs_last_n else 1
        rows = [None if i < first or entry is None else
                [(int(t), float(v["logprob"])) for t, v in entry.items()] for i, entry in enumerate(entries)]
        if req.prompt_logprobs:
            prompt_logprobs = [None if row is None else _own_logprob(tokens[i], row, i)
                               for i, row in enumerate(rows)]
        if req.topk_prompt_logprobs:
            topk_prompt = [None if row is None else _best(row, req.topk_prompt_logprobs) for row in rows]
    cells = prompt_scoring.target_cells(req, len(tokens))
    if len(prefix_answers) != prefix_count(req):
        raise ValueError(f"{len(prefix_answers)} answers to the prompt-prefix requests")
    answers = iter(prefix_answers)
    targets = None if cells is None else prompt_scoring.target_logprobs(next(answers), cells)
    alt = prompt_scoring.alt_tokens(next(answers), req, len(tokens)) if req.prompt_alt_tokens_k else None
    usage = vllm_json.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return encode_sample_response(sequences, prompt_logprobs, topk_prompt,
                                  sample_k=k_sample, prompt_k=req.topk_prompt_logprobs,
                                  target_prompt_logprobs=targets, prompt_alt_tokens=alt,
                                  prompt_cache_hit_tokens=int(cached))


def _sequence(choice: dict[str, Any], k: int) -> SampledSeq:
    index = choice["index"]
    finish = _FINISH_REASONS.get(choice.get("finish_reason") or "")
    if finish is None:
        raise ValueError(f"choice {index} did not finish normally: finish_reason "
                         f"{choice.get('finish_reason')!r}")
    tokens = choice.get("token_ids")
    logprobs = choice.get("logprobs") or {}
    if tokens is None or "token_logprobs" not in logprobs:
        raise ValueError(f"choice {index} has no token_ids or logprobs (were return_token_ids and "
                         "logprobs set?)")
    named = [_token_id(t) for t in logprobs["tokens"]]
    values = logprobs["token_logprobs"]
    if named != tokens or any(v is None for v in values):
        raise ValueError(f"choice {index}: the logprobs do not cover its {len(tokens)} tokens")
    topk = None
    if k:
        topk = [None if row is None else _best([(_token_id(t), float(v)) for t, v in row.items()], k)
                for row in logprobs["top_logprobs"]]
    return SampledSeq(tokens=list(tokens), stop_reason=finish, logprobs=[float(v) for v in values], topk=topk)


def _token_id(key: str) -> int:
    if not key.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"top-logprob key {key!r} is not token_id:N (return_tokens_as_token_ids unset?)")
    return int(key[len(TOKEN_ID_PREFIX):])


def _own_logprob(token: int, row: list[tuple[int, float]], position: int) -> float:
    for candidate, logprob in row:
        if candidate == token:
            return logprob
    raise ValueError(f"vLLM's prompt logprobs at {position} do not score the prompt's token {token}")


def _best(row: list[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    """The top k of a vLLM logprob dict's entries, best first. Its first entry is the token actually
    there (sampled, or the prompt's), then the top k: with k + 1 entries the first is not among them."""
    top = row[1:] if len(row) > k else row
    return sorted(top, key=lambda entry: -entry[1])[:k]
