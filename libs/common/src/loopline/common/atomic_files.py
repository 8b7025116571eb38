"""Replacing a file or a folder whole: a reader sees the old one or the new one, never a half-written
one, and a crash mid-write leaves the old one in place.

    file    the content goes to a temporary file beside the target (same folder, so same
            filesystem), which is then renamed over it: ``os.replace`` is atomic on POSIX
    folder  it is filled under a temporary name beside the target and renamed into place; a folder
            cannot be renamed over a non-empty one, so the old one is first renamed aside (the
            path names the old folder, then nothing for an instant, then the new one: never a
            partial one) and then removed

Temporary names start with "." (``.tmp-``, ``.old-``), so every reader of a job directory skips
them (job_layout), and are unique, so two writers never write into each other's.

Standard library only: the training program imports it inside a Slurm job.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

# Created with these permissions, less the umask: what open() and Path.write_text give a new file
# (a job's status.json is read by the trainer, which runs as another user), or owner-only for
# secrets, from their first byte.
PUBLIC_MODE = 0o666
PRIVATE_MODE = 0o600


def write_atomic(path: str | Path, data: str | bytes, *, private: bool = False, mode: int | None = None,
                 owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8). ``private``: readable and
    writable by its owner only; ``mode``: exactly these permissions (umask aside); ``owner``:
    (uid, gid) to give the file (root only).

    Safe in a folder someone else can write (a job's own, written by a root trainer): the
    temporary file is created exclusively, under a name nobody can guess, relative to the folder
    opened once, never through a link; its permissions and owner are set on the open file, and
    the rename replaces whatever entry ``path`` names (a planted link included) without following
    it."""
    path = Path(path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    temp = f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     PRIVATE_MODE if private or mode is not None else PUBLIC_MODE, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as out:
                if mode is not None:
                    os.fchmod(out.fileno(), mode)
                if owner is not None:
                    os.fchown(out.fileno(), *owner)
                out.write(data.encode() if isinstance(data, str) else data)
            os.replace(temp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp, dir_fd=folder)
            raise
    finally:
        os.close(folder)


@contextmanager
def atomic_dir(final: str | Path, *, temp_prefix: str | None = None,
               mode: int | None = 0o755) -> Iterator[Path]:
    """An empty folder beside ``final`` to fill; when the block ends without an error it replaces
    ``final`` whole (``replace_dir``), else it is removed. ``mode``: the folder's permissions once
    filled (mkdtemp makes it 0700; readers such as the checkpoint-watcher or an engine may run as
    other users); None keeps it private. ``temp_prefix``: the temporary name's start (default
    ``.tmp-<name>-``)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=temp_prefix or f".tmp-{final.name}-", dir=final.parent))
    try:
        yield temp
        if mode is not None:
            # On the opened folder, not its name: a chmod by name follows a link swapped in.
            fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        replace_dir(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def replace_dir(folder: str | Path, final: str | Path) -> None:
    """Rename the finished ``folder`` into place as ``final`` (in the same parent folder); an
    existing ``final`` is renamed aside first and then removed."""
    final = Path(final)
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(folder, final)
