"""One serving stack (tiny model, vLLM where installed) shared by the end-to-end tests that only
read from it; tests that break things start their own."""

from __future__ import annotations

import pytest

from support.stacks import make_stack, tiny_model


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


@pytest.fixture(scope="session")
def stack(tmp_path_factory, tiny):
    s = make_stack(tmp_path_factory.mktemp("stack"), tiny)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)
