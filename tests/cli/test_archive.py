"""The upload archive is deterministic and holds what the train route reads; bad JSONL is caught locally."""

from __future__ import annotations

import gzip
import io
import os
import tarfile

import pytest

from loopline.cli.archive import DATASET_NAME, DatasetError, pack_bytes, validate_jsonl

ROWS = b'{"input": "What is 2+2?", "output": "4"}\n{"input": "Capital of France?", "output": "Paris"}\n'


def _tree(root, when: int):
    """A dataset and an ml/ dir whose files all carry the mtime ``when``."""
    root.mkdir()
    (root / "data.jsonl").write_bytes(ROWS)
    ml = root / "ml"
    (ml / "cray_megatron").mkdir(parents=True)
    (ml / "cray_megatron" / "main.py").write_text("print('train')\n")
    (ml / "run.sh").write_text("#!/bin/sh\n")
    (ml / "run.sh").chmod(0o755)
    (ml / "__pycache__").mkdir()
    (ml / "__pycache__" / "x.cpython-311.pyc").write_bytes(os.urandom(16))  # must not count
    for path in [root / "data.jsonl", *ml.rglob("*"), ml]:
        os.utime(path, (when, when))
    return root / "data.jsonl", ml


def test_same_bytes_across_mtimes_and_runs(tmp_path):
    data_a, ml_a = _tree(tmp_path / "a", 1_000_000_000)
    data_b, ml_b = _tree(tmp_path / "b", 1_700_000_000)
    first = pack_bytes(data_a, ml_a)
    assert first == pack_bytes(data_a, ml_a)
    assert first == pack_bytes(data_b, ml_b)
    assert pack_bytes(data_a) == pack_bytes(data_b)
    assert first[4:8] == b"\0\0\0\0"  # the gzip header's mtime


def test_archive_contents(tmp_path):
    data, ml = _tree(tmp_path / "a", 1_000_000_000)
    with tarfile.open(fileobj=io.BytesIO(pack_bytes(data, ml)), mode="r:gz") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [DATASET_NAME, "ml", "ml/cray_megatron",
                                             "ml/cray_megatron/main.py", "ml/run.sh"]
        assert tar.extractfile(DATASET_NAME).read() == ROWS
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
        assert tar.getmember("ml/run.sh").mode == 0o755
        assert tar.getmember("ml/cray_megatron/main.py").mode == 0o644
    assert gzip.decompress(pack_bytes(data))  # plain gzip, readable by any tool


def test_validation_counts_examples(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(ROWS + b"\n")  # a trailing blank line is not an example, nor an error
    assert validate_jsonl(path).examples == 2


@pytest.mark.parametrize(("text", "line", "words"), [
    (b'{"input": "a", "output": "b"}\n{"input": "a", "output": "b"\n', 2, "not valid JSON"),
    (b'{"input": "a", "output": "b"}\n\n{"input": "a"}\n', 3, "missing field(s) 'output'"),
    (b'["input", "output"]\n', 1, "expected a JSON object"),
    (b'{"input": "a", "output": 7}\n', 1, "must be strings"),
    (b'{"input": "\xff", "output": "b"}\n', 1, "not valid UTF-8"),
])
def test_bad_lines_are_named(tmp_path, text, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(text)
    with pytest.raises(DatasetError) as caught:
        validate_jsonl(path)
    assert f"bad.jsonl:{line}: " in str(caught.value) and words in str(caught.value)


def test_empty_and_embedding_mode(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n")
    with pytest.raises(DatasetError, match="no examples"):
        validate_jsonl(path)
    path.write_text('{"sentence1": "a", "sentence2": "b", "score": 0.5}\n')
    assert validate_jsonl(path, "embedding").examples == 1
    with pytest.raises(DatasetError, match="missing"):
        validate_jsonl(path)
