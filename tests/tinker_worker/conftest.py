"""Fixtures for the session worker's compute: one resident tiny model shared by every test (each test
uses its own model ids), and helpers that build Tinker data from text."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from tinker.types import Datum

from loopline.tinker_worker.training import ResidentBase, TrainingClients
from support.stacks import tiny_model
from support.tinker_data import make_datum

# What the tiny model memorises (tests/ml/conftest.py's PAIRS, as Tinker SFT data).
PAIRS = [
    ("What is 1 + 1?", " The answer is 2."),
    ("Name a colour.", " Blue, like the sky."),
    ("Say hello.", " Hello there!"),
]


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return tiny_model()


@pytest.fixture(scope="session")
def resident(tiny_path) -> ResidentBase:
    return ResidentBase(tiny_path, device="cpu")


@pytest.fixture(scope="session")
def clients(resident) -> TrainingClients:
    return TrainingClients(resident)


@pytest.fixture
def new_id():
    """A fresh model id per call, so tests sharing the resident model never meet."""
    return lambda: f"{uuid.uuid4().hex}:train:0"


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def sft_datum(tokenizer, prompt: str, completion: str) -> Datum:
    """Tinker's SFT shape: input = sequence[:-1], targets = sequence[1:], weight 1 on the completion."""
    prompt_ids = tokenizer.encode(prompt)
    full = prompt_ids + tokenizer.encode(completion) + [tokenizer.eos_token_id]
    weights = np.array([0.0] * (len(prompt_ids) - 1) + [1.0] * (len(full) - len(prompt_ids)), np.float32)
    return make_datum(full[:-1], {"target_tokens": np.array(full[1:], np.int64), "weights": weights})


@pytest.fixture(scope="session")
def sft_data(tokenizer) -> list[Datum]:
    return [sft_datum(tokenizer, p, c) for p, c in PAIRS]
