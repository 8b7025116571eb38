"""Validate a JSONL training set and pack it into the upload archive the train route expects.

The archive is a tar.gz holding ``dataset.jsonlines`` and, optionally, an ``ml/`` directory. It is
byte-for-byte deterministic (sorted entries, zeroed mtime/uid/gid/owner names, normalised modes,
gzip header with mtime 0 and no file name) so that the same data and params always name the same
job, whichever way the server hashes the upload.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# loopline.common.contracts.job_layout.DATASET_FILE, which this HTTP-only package does not install
# (tests/common/test_contracts.py checks the two agree).
DATASET_NAME = "dataset.jsonlines"
MAX_REPORTED_ERRORS = 5
# Bytecode and editor droppings change between runs without changing the code, and would make
# every submit a new job.
_SKIP_DIRS = {"__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")


class DatasetError(ValueError):
    """The dataset cannot be trained on; ``problems`` are ``(line_number, message)`` pairs."""

    def __init__(self, path: Path, problems: list[tuple[int, str]], total: int):
        self.path, self.problems, self.total = path, problems, total
        lines = [f"{path}:{n}: {msg}" if n else f"{path}: {msg}" for n, msg in problems]
        if total > len(problems):
            lines.append(f"... and {total - len(problems)} more problem(s)")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class DatasetSummary:
    examples: int
    size: int


def required_fields(training_mode: str) -> tuple[str, ...]:
    # ScalarLM's embedding mode trains on sentence pairs; everything else on input/output text.
    return ("sentence1", "sentence2", "score") if training_mode == "embedding" else ("input", "output")


def validate_jsonl(path: Path, training_mode: str = "language_model") -> DatasetSummary:
    """Check every line before anything is uploaded: a bad line found by the trainer minutes later,
    inside a Slurm log, is much harder to act on than a line number now."""
    raw = path.read_bytes()  # an unreadable file is an OSError, reported as such by the caller
    fields = required_fields(training_mode)
    problems: list[tuple[int, str]] = []
    total = examples = 0

    def problem(n: int, msg: str) -> None:
        nonlocal total
        total += 1
        if len(problems) < MAX_REPORTED_ERRORS:
            problems.append((n, msg))

    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue  # blank lines (and the final newline) carry no example; jsonlines readers skip them
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            problem(n, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
            continue
        except json.JSONDecodeError as exc:
            problem(n, f"not valid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(record, dict):
            problem(n, f"expected a JSON object with {', '.join(fields)}, got {type(record).__name__}")
            continue
        missing = [f for f in fields if f not in record]
        if missing:
            problem(n, f"missing field(s) {', '.join(repr(m) for m in missing)}")
            continue
        wrong = [f for f in fields if f != "score" and not isinstance(record[f], str)]
        if wrong:
            problem(n, f"field(s) {', '.join(repr(w) for w in wrong)} must be strings")
            continue
        examples += 1
    if not total and not examples:
        problem(0, "no examples: the file is empty")
    if total:
        raise DatasetError(path, problems, total)
    return DatasetSummary(examples=examples, size=len(raw))


def _tarinfo(name: str, *, size: int = 0, directory: bool = False,
             executable: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.size = 0 if directory else size
    info.mode = 0o755 if directory or executable else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _ml_entries(ml_dir: Path) -> list[tuple[str, Path]]:
    """(archive name, source) for every directory and regular file under ml_dir, in sorted order."""
    entries: list[tuple[str, Path]] = [("ml", ml_dir)]
    for root, dirs, files in os.walk(ml_dir):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        rel = Path(root).relative_to(ml_dir)
        for d in dirs:
            entries.append(((Path("ml") / rel / d).as_posix(), Path(root) / d))
        for f in sorted(files):
            if not f.endswith(_SKIP_SUFFIXES) and (Path(root) / f).is_file():
                entries.append(((Path("ml") / rel / f).as_posix(), Path(root) / f))
    return sorted(entries)


def pack(dataset: Path, out: IO[bytes], ml_dir: Path | None = None) -> None:
    """Write the deterministic tar.gz of ``dataset`` (and ``ml_dir`` as ``ml/``) to ``out``."""
    # gzip's header holds a name and an mtime: both fixed here, which tarfile's "w:gz" cannot do.
    with (gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz,
          tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar):
        data = dataset.read_bytes()
        tar.addfile(_tarinfo(DATASET_NAME, size=len(data)), io.BytesIO(data))
        for name, src in _ml_entries(ml_dir) if ml_dir is not None else []:
            if src.is_dir():
                tar.addfile(_tarinfo(name, directory=True))
            else:
                with src.open("rb") as fh:
                    tar.addfile(_tarinfo(name, size=src.stat().st_size,
                                         executable=bool(src.stat().st_mode & 0o111)), fh)


def pack_bytes(dataset: Path, ml_dir: Path | None = None) -> bytes:
    buf = io.BytesIO()
    pack(dataset, buf, ml_dir)
    return buf.getvalue()
