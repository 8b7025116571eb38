"""The training archive a client uploads: read as a stream, checked, never extracted to disk.

A tar, tar.gz or plain (optionally gzipped) jsonlines file holding ``dataset.jsonlines`` and,
optionally, the job's own ``ml/`` code (kept as a deterministic tar, so equal code has an equal
hash: ``job_hash.py``).

The archive is untrusted input. Only regular files and directories with relative, non-escaping
names are accepted, and the uncompressed size is capped as it is read, so a small tar.gz cannot
inflate into gigabytes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Literal

from loopline.common.contracts.job_layout import CODE_DIR, DATASET_FILE

# The dataset is spooled to disk beyond this, so a large upload does not sit in memory.
SPOOL_BYTES = 8 * 1024 * 1024
# A job's own code is kept in memory (it is one tar in the object store); larger is refused.
MAX_CODE_BYTES = 64 * 1024 * 1024
_TAR_BLOCK = 512

TrainingMode = Literal["language_model", "embedding"]  # TrainParams.training_mode
# The string fields of a row in each training mode. An embedding row also has a "score": the cosine
# similarity its pair's embeddings are trained toward, so a number in [-1, 1] (sentence-transformers'
# STS data, which ScalarLM's embedding mode takes, scales it to [0, 1]).
TEXT_FIELDS: dict[str, tuple[str, str]] = {"language_model": ("input", "output"),
                                           "embedding": ("sentence1", "sentence2")}
SCORE_FIELD = "score"


# --- errors ----------------------------------------------------------------------------------------
class ArchiveError(ValueError):
    """The upload cannot be used; the message says why, for the user."""


class BadArchive(ArchiveError):
    """Not a readable tar, tar.gz or jsonlines file (corrupt, truncated)."""


class UnsafeArchive(ArchiveError):
    """A member that could escape or alias the job directory: absolute path, '..', link, device."""


class ArchiveTooLarge(ArchiveError):
    """More uncompressed bytes or members than allowed (a tar bomb, or simply too much data)."""


class LineTooLong(ArchiveTooLarge):
    """A dataset line longer than allowed, found before the line is held whole."""

    def __init__(self, number: int, limit: int):
        super().__init__(f"{DATASET_FILE} line {number} is longer than {limit} bytes")
        self.number, self.limit = number, limit


class InvalidDataset(ArchiveError):
    """dataset.jsonlines is missing, empty, or has a line that is not a training example."""


# --- reading an archive ----------------------------------------------------------------------------
@dataclass
class TrainingArchive:
    dataset: IO[bytes]  # dataset.jsonlines as uploaded, uncompressed, positioned at 0
    dataset_sha256: str
    dataset_bytes: int
    examples: int
    code: bytes | None = None  # a deterministic tar of ml/ (names sorted, owners and mtimes zeroed)
    code_sha256: str | None = None

    def close(self) -> None:
        self.dataset.close()

    def __enter__(self) -> TrainingArchive:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def read_training_archive(source: str | Path | IO[bytes], max_bytes: int, max_members: int,
                          max_line_bytes: int | None = None,
                          training_mode: TrainingMode = "language_model") -> TrainingArchive:
    """Read a tar, tar.gz or plain (optionally gzipped) jsonlines upload; ``source`` is a path or a
    seekable binary file. ``max_bytes`` caps the uncompressed content, ``max_members`` the entries,
    ``max_line_bytes`` one dataset line (without its newline; None: only ``max_bytes``); each row
    must be one of ``training_mode`` (TEXT_FIELDS)."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            return read_training_archive(f, max_bytes, max_members, max_line_bytes, training_mode)
    line_limit = max_bytes if max_line_bytes is None else max_line_bytes
    source.seek(0)
    try:
        stream = _decompressed(source)
        is_tar = _looks_like_tar(stream.read(_TAR_BLOCK))
        stream.seek(0)
        if is_tar:
            # Headers and padding come on top of the content; the cap still bounds what we inflate.
            capped = _Capped(stream, max_bytes + _TAR_BLOCK * (3 * max_members + 4), "the archive")
            return _read_tar(capped, max_bytes, max_members, line_limit, training_mode)
        capped = _Capped(stream, max_bytes, DATASET_FILE)
        dataset, sha, size, examples = _copy_dataset(_lines(io.BufferedReader(capped), line_limit),
                                                     training_mode)
        return TrainingArchive(dataset, sha, size, examples)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise BadArchive(f"the upload is not a readable tar, tar.gz or jsonlines file: {exc}") from exc


def _decompressed(f: IO[bytes]) -> IO[bytes] | gzip.GzipFile:
    magic = f.read(2)
    f.seek(0)
    return gzip.GzipFile(fileobj=f, mode="rb") if magic == b"\x1f\x8b" else f


def _looks_like_tar(block: bytes) -> bool:
    # POSIX, GNU and PAX headers all carry this magic; a jsonlines file cannot.
    return len(block) == _TAR_BLOCK and block[257:262] == b"ustar"


class _Capped(io.RawIOBase):
    """A read-only view that refuses to deliver more than ``limit`` bytes (the tar-bomb guard)."""

    def __init__(self, inner: IO[bytes] | gzip.GzipFile, limit: int, what: str):
        self.inner, self.limit, self.what, self.seen = inner, limit, what, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.inner.read(len(buffer))
        self.seen += len(data)
        if self.seen > self.limit:
            raise ArchiveTooLarge(f"{self.what} is larger than the limit of {self.limit} bytes uncompressed")
        buffer[: len(data)] = data
        return len(data)


def _read_tar(capped: _Capped, max_bytes: int, max_members: int, max_line_bytes: int,
              training_mode: TrainingMode) -> TrainingArchive:
    dataset: TrainingArchive | None = None
    code_files: dict[str, tuple[bytes, bool]] = {}
    members = total = code_bytes = 0
    try:
        # Stream mode ("r|"): headers and contents are read once, in order, through the cap.
        with tarfile.open(fileobj=io.BufferedReader(capped), mode="r|") as tar:
            for member in tar:
                members += 1
                if members > max_members:
                    raise ArchiveTooLarge(f"the archive has more than {max_members} entries")
                name = _safe_name(member)
                if name is None or member.isdir():
                    continue
                total += member.size
                if total > max_bytes:
                    raise ArchiveTooLarge(f"the archive's files add up to more than {max_bytes} bytes")
                if name == DATASET_FILE:
                    if dataset is not None:
                        raise InvalidDataset(f"the archive holds {DATASET_FILE} twice")
                    lines = _lines(_regular_file(tar, member), max_line_bytes)
                    dataset = TrainingArchive(*_copy_dataset(lines, training_mode))
                elif name.startswith(CODE_DIR + "/"):
                    if name in code_files:
                        raise UnsafeArchive(f"the archive holds {name} twice")
                    code_bytes += member.size
                    if code_bytes > MAX_CODE_BYTES:
                        raise ArchiveTooLarge(f"{CODE_DIR}/ is larger than {MAX_CODE_BYTES} bytes")
                    code_files[name] = (_regular_file(tar, member).read(), bool(member.mode & 0o111))
                # Anything else is not part of a job; it was checked for safety and is ignored.
    except tarfile.TarError as exc:
        if dataset is not None:
            dataset.close()
        raise BadArchive(f"the archive is not a valid tar: {exc}") from exc
    except BaseException:
        if dataset is not None:
            dataset.close()
        raise
    if dataset is None:
        raise InvalidDataset(f"the archive has no {DATASET_FILE} at its top level")
    if code_files:
        dataset.code = deterministic_tar(code_files)
        dataset.code_sha256 = hashlib.sha256(dataset.code).hexdigest()
    return dataset


def _safe_name(member: tarfile.TarInfo) -> str | None:
    """The member's normalised relative name, or None for the archive root; raise if it is unsafe."""
    raw = member.name
    if member.issym() or member.islnk():
        raise UnsafeArchive(f"{raw!r} is a link; links are not accepted in a training archive")
    if not (member.isreg() or member.isdir()):
        raise UnsafeArchive(f"{raw!r} is not a regular file or directory (device, fifo...)")
    if raw.startswith("/") or "\\" in raw or "\x00" in raw:
        raise UnsafeArchive(f"{raw!r} is an absolute or malformed path")
    parts = [p for p in PurePosixPath(raw).parts if p != "."]
    if ".." in parts:
        raise UnsafeArchive(f"{raw!r} points outside the archive ('..')")
    return "/".join(parts) or None


def _regular_file(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    contents = tar.extractfile(member)
    if contents is None:  # only for what is not a regular file, which _safe_name refused already
        raise UnsafeArchive(f"{member.name!r} is not a regular file")
    return contents


def _lines(f: IO[bytes], max_line_bytes: int) -> Iterator[bytes]:
    """``f``'s lines, each read only up to the limit: iterating a file would read a line whole, however
    long (a 39 KB gzip inflates to one 40 MB line), before anything could refuse it."""
    number = 0
    while line := f.readline(max_line_bytes + 1):
        number += 1
        if len(line) > max_line_bytes and not (len(line) == max_line_bytes + 1 and line.endswith(b"\n")):
            raise LineTooLong(number, max_line_bytes)
        yield line


def _copy_dataset(lines: Iterable[bytes], training_mode: TrainingMode) -> tuple[IO[bytes], str, int, int]:
    """Validate dataset.jsonlines line by line while spooling and hashing it as is."""
    out = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - returned open to the caller
    sha = hashlib.sha256()
    size = examples = 0
    try:
        for number, line in enumerate(lines, start=1):
            out.write(line)
            sha.update(line)
            size += len(line)
            if line.strip():
                _check_example(line, number, training_mode)
                examples += 1
    except BaseException:
        out.close()
        raise
    if examples == 0:
        out.close()
        raise InvalidDataset(f"{DATASET_FILE} has no examples: send at least one line "
                             f"{_row_shape(training_mode)}")
    out.seek(0)
    return out, sha.hexdigest(), size, examples


def _row_shape(training_mode: TrainingMode) -> str:
    first, second = TEXT_FIELDS[training_mode]
    score = f', "{SCORE_FIELD}": number' if training_mode == "embedding" else ""
    return f'{{"{first}": str, "{second}": str{score}}}'


def _check_example(line: bytes, number: int, training_mode: TrainingMode) -> None:
    where = f"{DATASET_FILE} line {number}"
    try:
        example = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidDataset(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise InvalidDataset(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(example, dict):
        raise InvalidDataset(f"{where}: expected an object {_row_shape(training_mode)}, "
                             f"got {type(example).__name__}")
    for key in TEXT_FIELDS[training_mode]:
        if not isinstance(example.get(key), str):
            if key not in example:
                raise InvalidDataset(f"{where}: {key!r} is missing")
            raise InvalidDataset(f"{where}: {key!r} must be a string, not {type(example[key]).__name__}")
    if training_mode == "embedding":
        _check_score(example.get(SCORE_FIELD), where)


def _check_score(score: object, where: str) -> None:
    if score is None:
        raise InvalidDataset(f"{where}: {SCORE_FIELD!r} is missing")
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise InvalidDataset(f"{where}: {SCORE_FIELD!r} must be a number, not {type(score).__name__}")
    if not -1 <= score <= 1:  # NaN too: every comparison with it is false
        raise InvalidDataset(f"{where}: {SCORE_FIELD!r} is out of range: a cosine similarity is in [-1, 1]")


def deterministic_tar(files: Mapping[str, tuple[bytes, bool]]) -> bytes:
    """An uncompressed tar of ``{name: (content, executable)}`` that depends on nothing else: sorted
    names, no mtimes, owners or umask, so equal code always has equal bytes and hash."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            content, executable = files[name]
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o755 if executable else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()
