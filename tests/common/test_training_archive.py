"""Training-archive reading (loopline.common.contracts.training_archive): pure functions, no services."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile

import pytest

from loopline.common.contracts import training_archive as archives
from loopline.common.contracts.job_hash import job_hash
from loopline.common.contracts.job_layout import DATASET_FILE

EXAMPLES = [{"input": "What is i + i?", "output": "The answer is 2i."}, {"input": "1+1", "output": "2"}]
DATASET = "".join(json.dumps(e) + "\n" for e in EXAMPLES).encode()
LIMIT = 1024 * 1024


def make_tar(members: list[tarfile.TarInfo | tuple[str, bytes]], *, gz: bool = False,
             mtime: int = 0) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                info.mtime = mtime
                tar.addfile(info, io.BytesIO(m[1]))
    data = raw.getvalue()
    # gzip puts its own mtime in the header, as ScalarLM's SDK does: the bytes differ per call.
    return gzip.compress(data, mtime=mtime) if gz else data


def read(data: bytes, max_bytes: int = LIMIT, max_members: int = 100) -> archives.TrainingArchive:
    return archives.read_training_archive(io.BytesIO(data), max_bytes, max_members)


# --- reading -------------------------------------------------------------------------------------
def test_same_data_gzipped_twice_gives_the_same_job():
    first = make_tar([(DATASET_FILE, DATASET)], gz=True, mtime=1000)
    second = make_tar([(DATASET_FILE, DATASET)], gz=True, mtime=2000)
    assert first != second  # what ScalarLM hashes differs...
    with read(first) as a, read(second) as b:
        assert a.dataset_sha256 == b.dataset_sha256 == hashlib.sha256(DATASET).hexdigest()
        assert job_hash({}, a.dataset_sha256) == job_hash({}, b.dataset_sha256)  # ...ours not
        assert a.examples == 2 and a.dataset_bytes == len(DATASET) and a.dataset.read() == DATASET
        assert a.code is None and a.code_sha256 is None


@pytest.mark.parametrize("packing", ["tar", "plain", "gzip"])
def test_every_packing_reads_the_same_dataset(packing):
    data = {"tar": make_tar([(f"./{DATASET_FILE}", DATASET)]), "plain": DATASET,
            "gzip": gzip.compress(DATASET, mtime=5)}[packing]
    with read(data) as archive:
        assert archive.dataset_sha256 == hashlib.sha256(DATASET).hexdigest() and archive.examples == 2


def test_ml_code_becomes_a_deterministic_tar():
    def archive(order, mtime):
        files = {"ml/cray_megatron/main.py": b"print('hi')\n", "ml/util.py": b"X = 1\n"}
        members = [(DATASET_FILE, DATASET)] + [(n, files[n]) for n in order]
        return make_tar(members, gz=True, mtime=mtime)

    with read(archive(["ml/util.py", "ml/cray_megatron/main.py"], 1)) as a, \
            read(archive(["ml/cray_megatron/main.py", "ml/util.py"], 99)) as b:
        assert a.code == b.code and a.code_sha256 == b.code_sha256 == hashlib.sha256(a.code).hexdigest()
        with tarfile.open(fileobj=io.BytesIO(a.code)) as tar:
            infos = tar.getmembers()
        assert [i.name for i in infos] == ["ml/cray_megatron/main.py", "ml/util.py"]
        assert all(i.mtime == 0 and i.uid == 0 and i.uname == "" for i in infos)


# --- unsafe archives ---------------------------------------------------------------------------------
def link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def device(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.CHRTYPE
    return info


@pytest.mark.parametrize("member, message", [
    (("../evil.py", b"x"), "outside"),
    (("ml/../../evil.py", b"x"), "outside"),
    (("/etc/cron.d/evil", b"x"), "absolute"),
    (link("ml/passwd", "/etc/passwd"), "link"),
    (link("ml/hard", DATASET_FILE, tarfile.LNKTYPE), "link"),
    (device("ml/null"), "device"),
])
def test_unsafe_members_are_refused(member, message):
    with pytest.raises(archives.UnsafeArchive, match=message):
        read(make_tar([(DATASET_FILE, DATASET), member], gz=True))


def test_tar_bombs_are_stopped():
    # 64 MiB of zeros compress to ~64 KiB: refused from the member's declared size, unread.
    bomb = make_tar([(DATASET_FILE, DATASET), ("ml/zeros.bin", bytes(64 * 1024 * 1024))], gz=True)
    assert len(bomb) < 200_000
    with pytest.raises(archives.ArchiveTooLarge, match="add up to more than"):
        read(bomb)
    # Bytes that are no member's content (a huge PAX header) are stopped while inflating.
    info = tarfile.TarInfo("ml/x.py")
    info.pax_headers = {"comment": "x" * (8 * LIMIT)}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(archives.ArchiveTooLarge, match="uncompressed"):
        read(gzip.compress(raw.getvalue()))
    with pytest.raises(archives.ArchiveTooLarge, match="uncompressed"):
        read(gzip.compress(b'{"input":"a","output":"b"}\n' + b" " * (4 * LIMIT)))


def test_too_many_members_are_refused():
    many = [(DATASET_FILE, DATASET)] + [(f"ml/f{i}.py", b"") for i in range(20)]
    with pytest.raises(archives.ArchiveTooLarge, match="more than 10 entries"):
        read(make_tar(many), max_members=10)


# --- bad datasets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, message", [
    (b'{"input": "a", "output": "b"}\n{"input": "a", "output": \n', "line 2: not valid JSON"),
    (b'{"input": "a", "output": "b"}\n\n["a", "b"]\n', "line 3: expected an object"),
    (b'{"input": "a"}\n', "line 1: 'output' is missing"),
    (b'{"input": 3, "output": "b"}\n', "line 1: 'input' must be a string, not int"),
    (b'{"input": "a", "output": "\xff"}\n', "line 1: not UTF-8"),
    (b"\n\n", "no examples"),
])
def test_bad_lines_are_reported_with_their_number(content, message):
    with pytest.raises(archives.InvalidDataset, match=message):
        read(make_tar([(DATASET_FILE, content)], gz=True))


PAIR = b'{"sentence1": "a", "sentence2": "b", "score": 0.5}\n'


@pytest.mark.parametrize("content, message", [
    (b'{"input": "a", "output": "b"}\n', "line 1: 'sentence1' is missing"),
    (PAIR + b'{"sentence1": "a", "sentence2": "b"}\n', "line 2: 'score' is missing"),
    (b'{"sentence1": "a", "sentence2": "b", "score": "0.5"}\n', "'score' must be a number, not str"),
    (b'{"sentence1": "a", "sentence2": "b", "score": true}\n', "'score' must be a number, not bool"),
    (b'{"sentence1": "a", "sentence2": "b", "score": -1.5}\n', "'score' is out of range"),
    (b'{"sentence1": "a", "sentence2": "b", "score": NaN}\n', "'score' is out of range"),
    (b'{"sentence1": "a", "sentence2": "b", "score": 1' + b"0" * 400 + b'}\n', "'score' is out of range"),
    (b"\n", 'no examples: send at least one line {"sentence1": str, "sentence2": str, "score": number}'),
])
def test_embedding_rows_are_scored_sentence_pairs(content, message):
    with pytest.raises(archives.InvalidDataset, match=re.escape(message)):
        archives.read_training_archive(io.BytesIO(content), LIMIT, 10, training_mode="embedding")


def test_embedding_rows_are_read_in_embedding_mode():
    data = PAIR + b'{"sentence1": "c", "sentence2": "d", "score": -1}\n'
    with archives.read_training_archive(io.BytesIO(gzip.compress(data)), LIMIT, 10,
                                        training_mode="embedding") as archive:
        assert archive.examples == 2 and archive.dataset.read() == data


def test_archive_without_dataset_or_corrupt_is_refused():
    with pytest.raises(archives.InvalidDataset, match=f"no {DATASET_FILE}"):
        read(make_tar([("data.jsonl", DATASET)]))
    with pytest.raises(archives.BadArchive):
        read(make_tar([(DATASET_FILE, DATASET)], gz=True)[:-30])  # truncated gzip


# --- one line's length -----------------------------------------------------------------------------
@pytest.mark.parametrize("packing", ["tar", "plain", "gzip"])
def test_a_line_longer_than_the_limit_is_refused_at_the_limit(packing):
    """A line of exactly the limit (newline aside) is read; one byte more is LineTooLong, raised
    having read no more than the limit of it (the line is never held whole)."""
    line = json.dumps({"input": "x" * 200, "output": "y"}).encode()
    pack = {"tar": lambda d: make_tar([(DATASET_FILE, d)]), "plain": lambda d: d,
            "gzip": lambda d: gzip.compress(d, mtime=5)}[packing]
    data = DATASET + line + b"\n" + DATASET
    with archives.read_training_archive(io.BytesIO(pack(data)), LIMIT, 100, len(line)) as archive:
        assert archive.examples == 5 and archive.dataset.read() == data
    # The last line, without a newline, counts the same way.
    with archives.read_training_archive(io.BytesIO(pack(DATASET + line)), LIMIT, 100, len(line)) as archive:
        assert archive.examples == 3
    with pytest.raises(archives.LineTooLong, match="line 3 is longer than") as refused:
        archives.read_training_archive(io.BytesIO(pack(data)), LIMIT, 100, len(line) - 1)
    assert refused.value.number == 3 and refused.value.limit == len(line) - 1
    assert isinstance(refused.value, archives.ArchiveTooLarge)  # a 413 wherever the size is
