"""From dataset.jsonlines to padded micro-batches, with a cursor that makes resuming exact.

Each line is ``{"input": str, "output": str}``. The text is input + output + EOS with no
template in between (as in ScalarLM); the loss covers the output tokens and the EOS only.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

IGNORE = -100  # cross_entropy's ignore_index: input and padding positions


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # same length; IGNORE where no loss is taken


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, t]
    attention_mask: torch.Tensor  # [b, t], 0 on padding
    labels: torch.Tensor  # [b, t], IGNORE on input and padding

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def read_rows(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("input", ""), str) \
                    or not isinstance(row.get("output", ""), str):
                raise ValueError(f"{path.name} line {number}: expected {{\"input\": str, \"output\": str}}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path.name} holds no examples")
    return rows


def tokenize(tokenizer, row: dict, eos_id: int, max_seq_len: int) -> Example:
    """Input and output are tokenized apart: the input exactly as an inference prompt would be
    (with the tokenizer's own special tokens, e.g. a BOS), so the model learns to continue the
    very token ids it will be served. Too-long examples are cut at the end."""
    prompt = tokenizer.encode(row.get("input", ""), add_special_tokens=True)
    answer = [*tokenizer.encode(row.get("output", ""), add_special_tokens=False), eos_id]
    ids = (prompt + answer)[:max_seq_len]
    labels = ([IGNORE] * len(prompt) + answer)[:max_seq_len]
    return Example(ids, labels)


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Right-pad to the longest example; padding is masked out of attention and loss."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e.labels)
    return Batch(ids, mask, labels)


@dataclass
class DataCursor:
    """Where the next example comes from: the epoch and the position in that epoch's order."""

    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


T = TypeVar("T")  # an example: Example here, a sentence pair in embedding mode (embedding.py)


class ExampleStream(Generic[T]):
    """Examples in a shuffled order that depends only on (seed, epoch), so a saved cursor is
    enough to continue exactly where a run stopped."""

    def __init__(self, examples: list[T], seed: int, cursor: DataCursor | None = None):
        self.examples = examples
        self.seed = seed
        self.cursor = cursor or DataCursor()
        self._order_epoch = -1
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            # Its own Random, so the order never depends on (or moves) the global RNG state.
            self._order = list(range(len(self.examples)))
            random.Random(f"loopline-data:{self.seed}:{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def take(self, n: int) -> list[T]:
        out = []
        for _ in range(n):
            c = self.cursor
            out.append(self.examples[self.order(c.epoch)[c.position]])
            c.position += 1
            if c.position == len(self.examples):
                c.epoch, c.position = c.epoch + 1, 0
        return out

    @property
    def epoch_progress(self) -> float:
        """Epochs done, fractional: 1.5 = one and a half passes over the data."""
        return self.cursor.epoch + self.cursor.position / len(self.examples)
