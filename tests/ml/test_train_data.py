"""Training data: the loss mask, padding, and a shuffling order that a saved cursor reproduces."""

from __future__ import annotations

import pytest

from loopline.ml.train.data import IGNORE, DataCursor, ExampleStream, collate, tokenize


@pytest.fixture(scope="module")
def tok(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def test_loss_mask_covers_exactly_the_output_and_eos(tok):
    row = {"input": "What is 1 + 1?", "output": " The answer is 2."}
    ex = tokenize(tok, row, tok.eos_token_id, max_seq_len=512)
    prompt = tok.encode(row["input"])
    assert ex.input_ids[: len(prompt)] == prompt  # the prompt exactly as inference tokenizes it
    assert ex.labels[: len(prompt)] == [IGNORE] * len(prompt)
    answer = ex.labels[len(prompt):]
    assert IGNORE not in answer and answer == ex.input_ids[len(prompt):]
    assert answer[-1] == tok.eos_token_id
    assert tok.decode(answer) == row["output"] + tok.eos_token

    short = tokenize(tok, {"input": "Hi", "output": " Yo"}, tok.eos_token_id, 512)
    batch = collate([ex, short], tok.pad_token_id)
    n = len(short.input_ids)
    assert batch.attention_mask[1].tolist() == [1] * n + [0] * (len(ex.input_ids) - n)
    assert batch.labels[1, n:].eq(IGNORE).all()  # padding takes no loss
    assert batch.tokens == len(ex.input_ids) + n


def test_max_seq_len_cuts_the_end(tok):
    row = {"input": "Say hello.", "output": " Hello there, my good friend!"}
    ex = tokenize(tok, row, tok.eos_token_id, 6)
    assert len(ex.input_ids) == len(ex.labels) == 6


def test_cursor_reproduces_the_order():
    examples = list(range(5))
    stream = ExampleStream(examples, seed=3)
    first = stream.take(7)  # crosses into the second epoch
    assert sorted(first[:5]) == examples and stream.cursor == DataCursor(epoch=1, position=2)
    saved = DataCursor(**stream.cursor.to_dict())
    rest = stream.take(9)
    assert ExampleStream(examples, seed=3, cursor=saved).take(9) == rest
    assert ExampleStream(examples, seed=3).take(16) == first + rest
    assert ExampleStream(examples, seed=4).take(5) != first[:5]  # the seed matters
    assert stream.epoch_progress == pytest.approx(3 + 1 / 5)
