"""The streamed reader of /v1/generate/upload's file (scalarlm/upload_entries.py): a pure function,
checked against json.loads on random documents cut into blocks of every small size."""

from __future__ import annotations

import io
import json
import random

import pytest

from loopline.gateway.scalarlm import upload_entries


def _value(rng: random.Random, depth: int = 0):
    kinds = 7 if depth < 3 else 4
    kind = rng.randrange(kinds)
    if kind == 0:
        return rng.randrange(-10**6, 10**6)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-3, 8)
    if kind == 2:
        return "".join(rng.choice('aé"\\\n𝄞x ') for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5:
        return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randrange(4))}
    return {"prompt": "p" * rng.randrange(30), "max_tokens": rng.randrange(1, 10**4)}


def test_entries_are_what_json_loads_reads_whatever_the_blocks(monkeypatch):
    rng = random.Random(23)
    for _ in range(1500):
        doc = [_value(rng) for _ in range(rng.randrange(6))]
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        # Small blocks cut numbers, strings, literals and UTF-8 sequences at every place.
        monkeypatch.setattr(upload_entries, "BLOCK", rng.randrange(1, 20))
        assert list(upload_entries.entries(io.BytesIO(text.encode()), 10**6)) == doc, text


@pytest.mark.parametrize("text", ["", "{}", "[", '[{"a": 1}', '[{"a": 1},]', '[{"a": x}]', "[1] 2",
                                  "[1 2]", '[{"a": tru}]', '["\\ud800"'])
def test_what_is_not_one_json_array_is_refused(monkeypatch, text):
    monkeypatch.setattr(upload_entries, "BLOCK", 3)
    with pytest.raises(upload_entries.NotAnArray):
        list(upload_entries.entries(io.BytesIO(text.encode()), 10**6))


def test_not_utf8_is_refused():
    with pytest.raises(upload_entries.NotAnArray, match="not UTF-8"):
        list(upload_entries.entries(io.BytesIO(b'["\xff"]'), 10**6))


def test_an_entry_beyond_the_limit_is_refused_before_it_is_read_whole(monkeypatch):
    monkeypatch.setattr(upload_entries, "BLOCK", 16)
    reads = []

    class Counting(io.BytesIO):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    data = b'[{"a": 1}, {"prompt": "' + b"x" * 10_000 + b'"}]'
    with pytest.raises(upload_entries.EntryTooLarge) as refused:
        list(upload_entries.entries(Counting(data), 100))
    assert refused.value.index == 1 and refused.value.limit == 100
    assert len(reads) * 16 < 300  # stopped soon after the limit, not at the end of the entry
