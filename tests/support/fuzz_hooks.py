"""Schemathesis hooks for the fuzz run (tests/e2e/test_fuzz.py), loaded by ``SCHEMATHESIS_HOOKS``.

A body the fuzzer makes names a random ``model`` and is refused with 404 before vLLM sees it; half of
the bodies name one of the stack's served models instead — the embedding model
(``LOOPLINE_FUZZ_EMBED_MODEL``) on the pooling routes, the generation model (``LOOPLINE_FUZZ_MODEL``)
elsewhere — so that vLLM's validation and the relay behind it are fuzzed too. The choice is the
fuzzer's own draw: a fixed seed replays it.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis
from hypothesis import strategies as st

from loopline.common.contracts.schemas import POOLING_ROUTES

SERVED_MODEL = os.environ["LOOPLINE_FUZZ_MODEL"]
EMBED_MODEL = os.environ.get("LOOPLINE_FUZZ_EMBED_MODEL", SERVED_MODEL)


def _naming(model: str):
    def name_served_model(drawn: tuple[Any, bool]) -> Any:
        body, served = drawn
        if served and isinstance(body, dict):
            return {**body, "model": model}
        return body

    return name_served_model


@schemathesis.hook
def before_generate_body(context, strategy):
    model = EMBED_MODEL if context.operation.path in POOLING_ROUTES else SERVED_MODEL
    return st.tuples(strategy, st.booleans()).map(_naming(model))
