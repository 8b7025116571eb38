"""Reading a file a job's code writes with a bound on what is held in memory.

The trainer reads every job's status, events and logs, all of them written by code it does not
trust: a file may be 64 GiB of one sparse line with no newline. Each read here holds at most its
limit (plus one byte, to tell "exactly the limit" from "more") whatever the file holds, and a line
too long to keep is skipped without being held, hopping over the file's holes (``SEEK_DATA``), so a
sparse region costs no reading at all.
"""

from __future__ import annotations

import errno
import os
from typing import BinaryIO

# How much of an over-long line is read at a time while looking for its end.
SKIP_CHUNK = 1024 * 1024


class TooLarge(Exception):
    """More than the limit: ``size`` bytes at least."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"{size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit


def read_all(f: BinaryIO, limit: int) -> bytes:
    """The whole file; TooLarge, before reading, when it is larger than ``limit`` (and when it grew
    past it while being read)."""
    size = os.fstat(f.fileno()).st_size
    if size > limit:
        raise TooLarge(size, limit)
    data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(len(data), limit)
    return data


def read_line(f: BinaryIO, limit: int) -> tuple[bytes, bool]:
    """The next line, newline included, and whether it is longer than ``limit`` bytes (newline not
    counted). Of a long line, its first ``limit`` + 1 bytes come back, the file left inside it (see
    ``skip_line``); a line without its newline yet (still being written) comes back as it is."""
    line = f.readline(limit + 1)
    return line, len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n"))


def skip_line(f: BinaryIO) -> tuple[int, bool]:
    """Read on to just after the next newline, or to the end of the file; returns the bytes passed
    and whether a newline ended them. Memory: one chunk. Time: the line's data, not its holes."""
    passed = 0
    while True:
        start = f.tell()
        data_at = _next_data(f.fileno(), start)
        if data_at is None:  # only a hole to the end: no newline in it
            end = max(os.fstat(f.fileno()).st_size, start)
            f.seek(end)
            return passed + end - start, False
        if data_at > start:
            f.seek(data_at)
            passed += data_at - start
        chunk = f.readline(SKIP_CHUNK)
        passed += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return passed, bool(chunk)


def _next_data(fd: int, offset: int) -> int | None:
    """The first offset at or after ``offset`` holding data; None when none does (a trailing hole,
    or the end). A filesystem that cannot tell says the offset itself: everything is data. The
    descriptor's own offset is put back: the buffered reader over it counts on it."""
    raw_at = os.lseek(fd, 0, os.SEEK_CUR)
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return offset
        raise
    finally:
        os.lseek(fd, raw_at, os.SEEK_SET)
