"""Schemathesis hooks for the fuzz run (tests/e2e/test_fuzz.py), loaded by ``SCHEMATHESIS_HOOKS``.

A body the fuzzer makes names a random ``model`` and is refused with 404 before vLLM sees it; half of
the bodies name the stack's served model (``LOOPLINE_FUZZ_MODEL``) instead, so that vLLM's
validation and the relay behind it are fuzzed too. The choice is the fuzzer's own draw: a fixed seed
replays it.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis
from hypothesis import strategies as st

SERVED_MODEL = os.environ["LOOPLINE_FUZZ_MODEL"]


def _name_served_model(drawn: tuple[Any, bool]) -> Any:
    body, served = drawn
    if served and isinstance(body, dict):
        return {**body, "model": SERVED_MODEL}
    return body


@schemathesis.hook
def before_generate_body(context, strategy):
    return st.tuples(strategy, st.booleans()).map(_name_served_model)
