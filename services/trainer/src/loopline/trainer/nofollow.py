"""Files in a folder a job's own code can write, opened by the trainer without following links.

The trainer may run as root, and a job's code owns its job directory: any name in it may be a link
to a file the job could not touch itself (``events.jsonl -> /etc/shadow``), a FIFO that blocks an
``open``, or a hard link. So every file the trainer opens there is opened relative to the folder,
opened once (``dir_fd``), with ``O_NOFOLLOW`` (a link is refused, not followed) and ``O_NONBLOCK``
(a FIFO cannot stall it), and is used only when the open file is a regular file with one link. A
name that fails these checks reads as missing, and is never written through.

The folder itself is opened by its full path: its own name sits in a folder only the trainer
writes (the jobs directory), so the job cannot swap it for a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from loopline.trainer import bounded

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotAFile(OSError):
    """The name is a link, a FIFO, a device, a folder, or a file with more than one name."""


@contextlib.contextmanager
def folder(path: Path) -> Iterator[int]:
    """The folder, opened for ``dir_fd`` use."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def open_file(dir_fd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``name`` in the folder, never through a link; raises NotAFile for anything but a regular
    file with one link (FileNotFoundError where it is missing and ``flags`` do not create it)."""
    try:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO nobody reads, opened to write
            raise NotAFile(exc.errno, f"{name} is not a regular file") from exc
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise NotAFile(errno.EPERM, f"{name} is not a regular file with one link")
    os.set_blocking(fd, True)
    return fd


def read_file(path: Path, max_bytes: int) -> bytes | None:
    """The whole file, or None where it is missing or not a plain file; bounded.TooLarge, before
    anything is read, where it holds more than ``max_bytes``."""
    try:
        with folder(path.parent) as dir_fd, os.fdopen(open_file(dir_fd, path.name), "rb") as f:
            return bounded.read_all(f, max_bytes)
    except OSError:
        return None


@contextlib.contextmanager
def open_read(path: Path) -> Iterator[BinaryIO]:
    """``open(path, "rb")`` that refuses links; FileNotFoundError (an OSError) for anything not a
    plain file, so a caller's "missing" branch covers a planted link as well."""
    with folder(path.parent) as dir_fd:
        try:
            fd = open_file(dir_fd, path.name)
        except NotAFile as exc:
            raise FileNotFoundError(errno.ENOENT, str(exc)) from exc
    with os.fdopen(fd, "rb") as f:
        yield f


def open_append(path: Path) -> BinaryIO:
    """``open(path, "ab", buffering=0)`` that refuses links (a run's log, for its stdout)."""
    with folder(path.parent) as dir_fd:
        fd = open_file(dir_fd, path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return os.fdopen(fd, "ab", buffering=0)


def append(path: Path, data: bytes, *, owner: tuple[int, int] | None = None) -> int:
    """Append the line ``data`` in one write (O_APPEND), creating the file if missing (given to
    ``owner``, so the job's program can append to it too); returns the offset just after it. A
    link, FIFO or hard link planted under the name is removed (the name, never its target) and a
    fresh file takes its place: the trainer's line is written, and nowhere else. Where the file
    does not end with a newline (a program killed mid-line, or one writing junk), the line starts
    with one: it is a line of its own, never the end of another."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT  # read too: its last byte
    with folder(path.parent) as dir_fd:
        try:
            fd = open_file(dir_fd, path.name, flags, 0o640)
        except NotAFile:
            os.unlink(path.name, dir_fd=dir_fd)
            fd = open_file(dir_fd, path.name, flags | os.O_EXCL, 0o640)
        try:
            if owner is not None and os.fstat(fd).st_uid != owner[0]:
                os.fchown(fd, *owner)
            os.write(fd, data if _ends_a_line(fd) else b"\n" + data)
            return os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND wrote at the end: this is our line's end
        finally:
            os.close(fd)


def _ends_a_line(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size == 0 or os.pread(fd, 1, size - 1) == b"\n"


def owner_of(path: Path) -> tuple[int, int] | None:
    """(uid, gid) of the folder ``path`` is in, when the trainer (root) should give a file it
    creates there to that owner; None when the trainer owns the folder or cannot give files away."""
    if os.geteuid() != 0:
        return None
    info = os.stat(path.parent)
    return None if info.st_uid == 0 else (info.st_uid, info.st_gid)
