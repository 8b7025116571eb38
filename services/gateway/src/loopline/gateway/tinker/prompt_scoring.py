"""What a Tinker ``SampleRequest`` asks of its prompt beyond vLLM's prompt logprobs:
``target_prompt_logprobs`` (the exact logprobs of given ids at given prompt positions) and
``prompt_alt_tokens_k`` (k draws from the model's next-token distribution at every prompt position
after the first). Pure functions: a second vLLM ``/v1/completions`` request for them, and its
answer as the SDK's tensors.

Why a second request whose prompts are the prompt's prefixes. Row ``i`` of either is about prompt
position ``i + 1``: the model's next-token distribution after ``prompt[:i + 1]``. vLLM 0.32's
``/v1/completions`` scores a prompt's own tokens and its top k (``prompt_logprobs``), never given
ids; its engine has ``prompt_logprob_token_ids``, but only under the V2 model runner and only on
the token-in-token-out endpoint, not on the ``/v1/completions`` path our replicas serve and queue.
What ``/v1/completions`` does give is ``logprob_token_ids``: the exact logprobs of given ids at a
*generated* position. The first generated position after the prefix ``prompt[:i + 1]`` is prompt
position ``i + 1``, so one request whose prompt is the list of those prefixes, ``max_tokens`` 1,
scores every row (measured on the tiny model: the same value as ``prompt_logprobs`` gives for that
token, to the last digit), and with ``n = k`` at the request's temperature it draws the
alternatives. vLLM's prefix cache lets the prefixes share their work. A top-k large enough to hold
any id (``prompt_logprobs`` of the whole vocabulary) would cost vocabulary x prompt entries.
Not the session worker: a sampler's weights (a saved adapter, pinned) need not be loaded in any
worker, while vLLM serves exactly the weights that were sampled.

Targets are scored at temperature 1 with neither top-k nor top-p, so the logprobs are the model's
own whichever logprobs mode vLLM runs in. The draws are at the request's temperature; their
logprobs are what the sampler answers for sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker import types as tt

from loopline.gateway.tinker.proto import TargetLogprobs

# One prefix is one sequence for vLLM: at most this many in the second request (the rows a
# target tensor names, or len(prompt) - 1 rows x k draws), which bounds its work and its answer
# (under NATS's payload limit with the most ids).
MAX_PROMPT_PREFIXES = 512
# Distinct ids a target_prompt_logprobs tensor may name (each prefix's answer lists every one).
MAX_TARGET_IDS = 32
TOKEN_ID_PREFIX = "token_id:"


class PromptScoringError(ValueError):
    """A target tensor or alt-token count this server refuses: answered with a 400 naming it."""


@dataclass
class TargetCells:
    """A ``target_prompt_logprobs`` tensor as cells: ``ids[c]`` (-1: none) at row ``rows[c]``, in the
    tensor's own order (dense row-major, or its CSR values), and the layout the answer repeats."""

    ids: np.ndarray  # int64
    rows: np.ndarray  # int64
    shape: list[int]
    crow_indices: list[int] | None = None
    col_indices: list[int] | None = None

    def scored_rows(self) -> list[int]:
        """The rows that name an id, ascending: each is one prefix of the second request."""
        return sorted({int(r) for r in self.rows[self.ids >= 0]})

    def distinct_ids(self) -> list[int]:
        return sorted({int(t) for t in self.ids[self.ids >= 0]})


def target_cells(req: tt.SampleRequest, n_prompt: int) -> TargetCells | None:
    """The request's target tensor, checked (dtype, shape, CSR indices, limits), or None."""
    tensor = req.target_prompt_logprobs
    if tensor is None:
        return None
    name = "target_prompt_logprobs"
    if tensor.dtype != "int64":
        raise PromptScoringError(f"{name} must be an int64 tensor of token ids, not {tensor.dtype}")
    shape = list(tensor.shape or [])
    if len(shape) != 2 or shape[0] != n_prompt - 1 or shape[1] < 1:
        raise PromptScoringError(f"{name} must have shape [len(prompt) - 1, K] = [{n_prompt - 1}, K] with "
                                 f"K >= 1, not {shape}")
    ids = np.asarray(tensor.data, dtype=np.int64)
    rows_n, width = shape
    crow, col = tensor.sparse_crow_indices, tensor.sparse_col_indices
    if crow is None and col is None:
        if ids.size != rows_n * width:
            raise PromptScoringError(f"{name}: {ids.size} values do not fill shape {shape}")
        rows = np.repeat(np.arange(rows_n, dtype=np.int64), width)
    else:
        crow_a = np.asarray(crow or [], dtype=np.int64)
        col_a = np.asarray(col or [], dtype=np.int64)
        if (crow_a.size != rows_n + 1 or crow_a[0] != 0 or crow_a[-1] != ids.size or col_a.size != ids.size
                or np.any(np.diff(crow_a) < 0) or np.any(col_a < 0) or np.any(col_a >= width)):
            raise PromptScoringError(f"{name}: its sparse CSR indices do not describe {ids.size} values of "
                                     f"shape {shape}")
        rows = np.repeat(np.arange(rows_n, dtype=np.int64), np.diff(crow_a))
    if ids.size and ids.min() < -1:
        raise PromptScoringError(f"{name} holds token ids, or -1 for none; not {int(ids.min())}")
    cells = TargetCells(ids, rows, shape, None if crow is None else list(crow),
                        None if col is None else list(col))
    n_rows, n_ids = len(cells.scored_rows()), len(cells.distinct_ids())
    if n_ids == 0:
        raise PromptScoringError(f"{name} names no token id (every cell is -1)")
    if n_rows > MAX_PROMPT_PREFIXES:
        raise PromptScoringError(f"{name} names ids in {n_rows} rows; this server scores at most "
                                 f"{MAX_PROMPT_PREFIXES} (MAX_PROMPT_PREFIXES) in one request")
    if n_ids > MAX_TARGET_IDS:
        raise PromptScoringError(f"{name} names {n_ids} distinct ids; this server scores at most "
                                 f"{MAX_TARGET_IDS} (MAX_TARGET_IDS) in one request")
    return cells


def check_alt_tokens(req: tt.SampleRequest, n_prompt: int) -> None:
    k = req.prompt_alt_tokens_k
    if k < 0:
        raise PromptScoringError(f"prompt_alt_tokens_k must be 0 or more, not {k}")
    if k and (n_prompt - 1) * k > MAX_PROMPT_PREFIXES:
        raise PromptScoringError(f"prompt_alt_tokens_k={k} on a {n_prompt}-token prompt asks for "
                                 f"{(n_prompt - 1) * k} draws; this server draws at most "
                                 f"{MAX_PROMPT_PREFIXES} (MAX_PROMPT_PREFIXES) in one request")
    if k and n_prompt < 2:
        raise PromptScoringError("prompt_alt_tokens_k needs a prompt of 2 tokens or more")


def _prefix_body(served_model: str, tokens: list[int], rows: list[int], **params: Any) -> dict[str, Any]:
    return {"model": served_model, "prompt": [tokens[:row + 1] for row in rows], "max_tokens": 1,
            "return_tokens_as_token_ids": True, **params}


def target_body(cells: TargetCells, tokens: list[int], served_model: str) -> dict[str, Any]:
    """vLLM's request that scores ``cells``: one prefix per scored row, the ids at its first
    generated position (temperature 1, no top-k/top-p: the model's own logprobs)."""
    ids = cells.distinct_ids()
    return _prefix_body(served_model, tokens, cells.scored_rows(), n=1, temperature=1.0, top_p=1.0, top_k=-1,
                        logprobs=len(ids), logprob_token_ids=ids)


def alt_body(req: tt.SampleRequest, tokens: list[int], served_model: str) -> dict[str, Any]:
    """vLLM's request that draws ``prompt_alt_tokens_k`` tokens after every prefix, at the request's
    temperature (0: the argmax, k times; vLLM refuses n > 1 when greedy)."""
    temperature = req.sampling_params.temperature
    params: dict[str, Any] = {"n": 1 if temperature == 0 else req.prompt_alt_tokens_k,
                              "temperature": temperature, "logprobs": 0}
    if req.sampling_params.seed is not None:
        params["seed"] = req.sampling_params.seed
    return _prefix_body(served_model, tokens, list(range(len(tokens) - 1)), **params)


def _first_position(choice: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A prefix's generated token and its first position's logprob dict, keyed by token id."""
    logprobs = choice.get("logprobs") or {}
    tops, tokens = logprobs.get("top_logprobs") or [], logprobs.get("tokens") or []
    if not tops or not tokens or tops[0] is None:
        raise ValueError(f"prefix choice {choice.get('index')} has no logprobs")
    return _token_id(tokens[0]), {str(_token_id(key)): float(v) for key, v in tops[0].items()}


def _token_id(key: str) -> int:
    if not key.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"logprob key {key!r} is not token_id:N")
    return int(key[len(TOKEN_ID_PREFIX):])


def _choices(vllm_json: dict[str, Any], expected: int) -> list[dict[str, Any]]:
    choices = sorted(vllm_json.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != expected:
        raise ValueError(f"vLLM answered {len(choices)} choices to the prompt-prefix request, not {expected}")
    return choices


def target_logprobs(vllm_json: dict[str, Any], cells: TargetCells) -> TargetLogprobs:
    """vLLM's answer to ``target_body(cells, ...)`` as the SDK's tensor: the layout of the request's,
    0.0 in cells that named no id."""
    rows = cells.scored_rows()
    by_row = {row: _first_position(choice)[1] for row, choice in zip(rows, _choices(vllm_json, len(rows)),
                                                                       strict=True)}
    values = np.zeros(cells.ids.size, dtype=np.float32)
    # Invariant: values[:c] hold the logprobs of cells [0, c) (0.0 where a cell named none).
    for c, (token, row) in enumerate(zip(cells.ids.tolist(), cells.rows.tolist(), strict=True)):
        if token >= 0:
            found = by_row[row].get(str(token))
            if found is None:
                raise ValueError(f"vLLM did not score token {token} at prompt position {row + 1}")
            values[c] = found
    return TargetLogprobs(values, cells.shape, cells.crow_indices, cells.col_indices)


def alt_tokens(vllm_json: dict[str, Any], req: tt.SampleRequest,
               n_prompt: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's answer to ``alt_body`` as ``[len(prompt) - 1, k]`` (token ids int64, logprobs float32)."""
    k, rows = req.prompt_alt_tokens_k, n_prompt - 1
    per_prefix = 1 if req.sampling_params.temperature == 0 else k
    draws = [_first_position(choice) for choice in _choices(vllm_json, rows * per_prefix)]
    ids = np.array([token for token, _ in draws], dtype=np.int64).reshape(rows, per_prefix)
    logprobs = np.array([top[str(token)] for token, top in draws], dtype=np.float32).reshape(rows, per_prefix)
    if per_prefix != k:  # greedy: the one draw, k times
        ids, logprobs = np.repeat(ids, k, axis=1), np.repeat(logprobs, k, axis=1)
    return ids, logprobs
