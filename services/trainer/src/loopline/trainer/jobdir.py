"""The job directory: what the trainer writes for a job to run, and reads back while it runs.

The layout and its names are loopline.common.contracts.job_layout's. A new job's directory is staged
under a temporary name and renamed into place, so a directory under its hash is always complete.

A job's own code owns its directory (``give_to``), so the trainer, which may be root, treats every
name in it as hostile: it opens them without following links (``nofollow``), and keeps what the job
must not touch in the job's control directory beside it, ``<jobs_dir>/.control/<hash>/`` (the
trainer's alone, 0700): the entrypoint the launcher runs as root, the worker's credential, and one
log per allocation, ``slurm-<id>.out`` or ``local-<id>.out`` (written by the launcher, or by Slurm as
root: in the job's directory a planted link would aim those writes anywhere).
Nothing here talks to NATS or SQL.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import re
import shlex
import shutil
import stat
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from loopline.common.atomic_files import replace_dir, write_atomic
from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts.job_env import JobUser
from loopline.common.contracts.job_layout import (
    CHECKPOINTS_DIR,
    CODE_DIR,
    ENTRYPOINT_FILE,
    EVENTS_FILE,
    STATUS_FILE,
    checkpoint_step,
)
from loopline.common.contracts.train_params import JobConfig
from loopline.trainer import bounded, nofollow
from loopline.trainer.errors import InvalidRequest

MAX_CODE_MEMBERS = 10_000
_LOG_NAME = re.compile(r"^(slurm|local)-(.+)\.out$")
CONTROL_DIR = ".control"
# Sourced by the entrypoint, so a credential (the session worker's NATS password) is in no script.
SECRET_ENV_FILE = "secret.env"
# A job's directory: its user's, the trainer's group may read (checkpoints, status), nobody else.
# Set-group-id, so what the job creates is the trainer's group's too.
JOB_DIR_MODE = 0o2750
# One job given its uid at a time: two must not pick the same free one.
_GIVING = threading.Lock()


def _default(field: str) -> int:
    return TrainerSettings.model_fields[field].default


@dataclass(frozen=True)
class ReadLimits:
    """How much of what a job writes the trainer reads (TrainerSettings' fields of these names)."""

    max_status_bytes: int = _default("max_status_bytes")
    max_event_line_bytes: int = _default("max_event_line_bytes")
    max_log_line_bytes: int = _default("max_log_line_bytes")
    max_log_page_bytes: int = _default("max_log_page_bytes")
    max_history_points: int = _default("max_history_points")

    @classmethod
    def of(cls, settings: TrainerSettings) -> ReadLimits:
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})


DEFAULT_LIMITS = ReadLimits()


class OverLimit(Exception):
    """A file of the job's is larger than the trainer reads: the job is failed with this reason."""


def _setting(field: str) -> str:
    return f"LOOPLINE_{field.upper()}"


def log_name(launcher: str, run_id: str) -> str:
    """The log of one allocation in the job directory; Slurm's is named with ``%j`` for its id."""
    return f"{launcher}-{run_id}.out"


# --- writing a new job -----------------------------------------------------------------------------
def staging_dir(jobs_dir: Path, job_hash: str) -> Path:
    jobs_dir.mkdir(parents=True, exist_ok=True)
    path = jobs_dir / f".staging-{job_hash}-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    # No other job's user may enter it: its dataset is this job's alone.
    path.chmod(0o750)
    return path


def control_dir(job_dir: Path) -> Path:
    """The trainer's own folder for a job (entrypoint, logs, secrets), beside the job's."""
    return job_dir.parent / CONTROL_DIR / job_dir.name


def make_control_dir(job_dir: Path) -> Path:
    folder = control_dir(job_dir)
    folder.parent.mkdir(mode=0o700, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def clean_staging(jobs_dir: Path) -> None:
    """Remove half-staged jobs a crash left behind (call at start, before any submit)."""
    for leftover in jobs_dir.glob(".staging-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def install(staging: Path, final: Path) -> None:
    """Move a fully written job directory into place; a leftover under the same name (a crash
    between this rename and the registry insert) is replaced."""
    replace_dir(staging, final)


def write_config(job_dir: Path, config: JobConfig) -> None:
    config.write(job_dir)


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]


def write_entrypoint(job_dir: Path, argv: list[str], *, user_code: bool,
                     env: dict[str, str] | None = None, secret_env: dict[str, str] | None = None,
                     run_as: JobUser | None = None) -> Path:
    """The script the launcher runs, in the job's control directory (the job's code cannot replace
    it: the launcher runs it as the trainer's user); returns its path. ``argv`` is the full training
    command (srun included), run with ``env`` exported on top of the launcher's allowlist of the
    trainer's environment, and ``secret_env`` (a session worker's own NATS credential) read from a
    0600 file beside the script, so the script itself holds none. ``run_as``: the program in
    ``argv`` already drops to that user, whose HOME becomes the job directory (its own, e.g.
    /nonexistent, would fail every cache a library writes)."""
    control = make_control_dir(job_dir)
    lines = [
        "#!/usr/bin/env bash",
        "# Written by the Loopline trainer; run by sbatch or the local launcher.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(job_dir))}",
        f"export LOOPLINE_JOB_DIR={shlex.quote(str(job_dir))}",
    ]
    lines += _exports(env or {})
    secrets_file = control / SECRET_ENV_FILE
    if secret_env:
        write_atomic(secrets_file, "\n".join(_exports(secret_env)) + "\n", mode=0o600)
        lines.append(f". {shlex.quote(str(secrets_file))}")
    else:
        secrets_file.unlink(missing_ok=True)
    if run_as is not None:
        lines.append(f"export HOME={shlex.quote(str(job_dir))} USER={run_as.name} LOGNAME={run_as.name}")
    if user_code:
        # The job's own ml/ shadows the installed loopline.ml (ScalarLM's "edit the loop locally").
        code = shlex.quote(str(job_dir / CODE_DIR))
        lines.append(f'export PYTHONPATH={code}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    if argv and argv[0] == "srun":
        # For torch.distributed's env:// rendezvous: the first node of the allocation hosts it.
        lines.append('export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"')
        lines.append('export MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"')
    # exec: the program is the batch shell, so Slurm's B:TERM reaches it directly.
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    path = control / ENTRYPOINT_FILE
    # Made whole under a fresh name and renamed into place: never written or chmod-ed by name.
    write_atomic(path, "\n".join(lines) + "\n", mode=0o700)
    return path


def give_to(job_dir: Path, user: JobUser) -> JobUser:
    """Make the job directory the job user's (for a range of users, a uid no other job has, kept
    from an earlier run), so its program can write status, events and checkpoints there, and no
    other job's user can enter it; the trainer's group reads it. Returns the user the job runs as.
    The walk is by open folders, never by path, and touches no link's target: it may run on a
    folder the job's code has had its hands on."""
    with _GIVING:
        owner = os.lstat(job_dir).st_uid
        if user.per_job:
            in_range = user.uid <= owner < user.uid + user.count
            user = user.for_uid(owner if in_range else _free_uid(job_dir, user))
        if owner != user.uid:
            _give_tree(job_dir, user.uid, os.getegid())
    return user


def _free_uid(job_dir: Path, user: JobUser) -> int:
    """A uid of the range owning no other job's directory, from a start the job's name picks."""
    taken = set()
    with os.scandir(job_dir.parent) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                taken.add(entry.stat(follow_symlinks=False).st_uid)
    start = int.from_bytes(job_dir.name.encode()[-8:].ljust(8, b"\0"), "big") % user.count
    for i in range(user.count):
        uid = user.uid + (start + i) % user.count
        if uid not in taken:
            return uid
    raise InvalidRequest(f"every uid of LOOPLINE_JOB_UID_RANGE owns a job directory already "
                         f"({user.count} of them); delete finished jobs")


def _give_tree(job_dir: Path, uid: int, gid: int) -> None:
    for _root, dirs, files, dir_fd in os.fwalk(job_dir, follow_symlinks=False):
        os.fchown(dir_fd, uid, gid)
        os.fchmod(dir_fd, JOB_DIR_MODE)
        for name in (*dirs, *files):
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                continue  # its own turn in the walk
            if not stat.S_ISREG(info.st_mode):
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)  # the link, not its target
                continue
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                os.fchown(fd, uid, gid)
                owner_bits = (info.st_mode & 0o700) | 0o600
                os.fchmod(fd, owner_bits | ((owner_bits >> 3) & 0o050))  # group: read (and run)
            finally:
                os.close(fd)


def extract_code(tar_path: Path, job_dir: Path, max_bytes: int) -> None:
    """Unpack the job's ml/ code tar into ``job_dir``/ml, refusing anything that could write
    outside it: absolute names, '..', links, devices; and more than ``max_bytes`` of files."""
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            members = tar.getmembers()
            if len(members) > MAX_CODE_MEMBERS:
                raise InvalidRequest(f"the code archive has more than {MAX_CODE_MEMBERS} entries")
            total = 0
            for member in members:
                _check_code_member(member)
                total += member.size
                if total > max_bytes:
                    raise InvalidRequest(f"the code archive holds more than {max_bytes} bytes")
            for member in members:
                _unpack_member(tar, member, job_dir)
    except (tarfile.TarError, OSError) as exc:
        raise InvalidRequest(f"the code archive cannot be unpacked: {exc}") from exc


def _unpack_member(tar: tarfile.TarFile, member: tarfile.TarInfo, job_dir: Path) -> None:
    """One checked member, written by us rather than ``extractall``: the archive's owner, mode
    bits beyond "executable" and times are not kept (as root, ``extractall`` would give a file the
    uid and set-uid bit the archive names), and each file is created exclusively, following no
    link. (Python's "data" filter does this from 3.11.4; Debian bookworm's python3 is 3.11.2.)"""
    path = job_dir.joinpath(*_member_parts(member))
    if member.isdir():
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
        return
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    mode = 0o755 if member.mode & 0o100 else 0o644
    source = tar.extractfile(member)
    if source is None:  # not a regular file: _check_code_member refused it already
        raise InvalidRequest(f"code archive: {member.name!r} is not a regular file")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with source, os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(source, out)


def _member_parts(member: tarfile.TarInfo) -> list[str]:
    """A member's path inside the job directory, as parts ("./ml/x.py" is ml, x.py)."""
    return [p for p in PurePosixPath(member.name).parts if p != "."]


def _check_code_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if member.issym() or member.islnk():
        raise InvalidRequest(f"code archive: {name!r} is a link; links are refused")
    if not (member.isreg() or member.isdir()):
        raise InvalidRequest(f"code archive: {name!r} is not a regular file or directory")
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise InvalidRequest(f"code archive: {name!r} is an absolute or malformed path")
    parts = _member_parts(member)
    if ".." in parts:
        raise InvalidRequest(f"code archive: {name!r} points outside the job directory")
    if not parts or parts[0] != CODE_DIR:
        raise InvalidRequest(f"code archive: {name!r} is not under {CODE_DIR}/")


# --- reading what the program writes ---------------------------------------------------------------
def read_status(job_dir: Path, max_bytes: int = DEFAULT_LIMITS.max_status_bytes) -> dict[str, Any] | None:
    """status.json as a dict (None where missing or not a JSON object); OverLimit, before it is
    read, where it is larger than ``max_bytes``."""
    try:
        raw = nofollow.read_file(job_dir / STATUS_FILE, max_bytes)
    except bounded.TooLarge as exc:
        raise OverLimit(f"{STATUS_FILE} holds {exc.size} bytes, more than the trainer reads "
                        f"({exc.limit}, {_setting('max_status_bytes')})") from None
    try:
        status = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None
    return status if isinstance(status, dict) else None


def mark_requeued(job_dir: Path, max_bytes: int = DEFAULT_LIMITS.max_status_bytes) -> None:
    """Before a restart: status.json still says FAILED (or a stale TRAINING) until the program
    rewrites it; make it QUEUED so nothing reads the old ending as the new run's. One too large to
    read is replaced by a bare QUEUED: the run starts from its checkpoint and writes its own."""
    try:
        status = read_status(job_dir, max_bytes)
    except OverLimit:
        status = {}
    if status is None:
        return
    status.update(status="QUEUED", error=None, updated_at=time.time())
    path = job_dir / STATUS_FILE
    write_atomic(path, json.dumps(status, indent=1) + "\n", owner=nofollow.owner_of(path))


def _event_lines(f: BinaryIO, max_line_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(line, its length in the file) of each complete line from the file's position, an over-long
    one as b"" (passed over, never held); ends before a line still being written."""
    while True:
        line, too_long = bounded.read_line(f, max_line_bytes)
        if too_long:
            rest, ended = bounded.skip_line(f)
            if not ended:
                return
            yield b"", len(line) + rest
        elif line.endswith(b"\n"):
            yield line, len(line)
        else:
            return


def read_events(job_dir: Path, offset: int, max_lines: int, until: int | None = None, *,
                max_line_bytes: int = DEFAULT_LIMITS.max_event_line_bytes, max_bytes: int | None = None,
                skip_long: bool = False) -> tuple[list[bytes], int]:
    """Complete lines of events.jsonl from byte ``offset`` (a line still being written is left for
    next time), none ending past ``until``, about ``max_bytes`` of them at most; and the offset just
    after the last one returned. A line longer than ``max_line_bytes`` at ``offset`` is OverLimit,
    found without reading it; with ``skip_long`` (a job already over, its last lines published) it
    is passed over instead, returned as b"" (no event)."""
    budget = max_bytes if max_bytes is not None else max_lines * max_line_bytes
    try:
        with nofollow.open_read(job_dir / EVENTS_FILE) as f:
            f.seek(offset)
            lines: list[bytes] = []
            held = 0
            while len(lines) < max_lines and held < budget:
                start = f.tell()
                line, too_long = bounded.read_line(f, max_line_bytes)
                length = len(line)
                if too_long:
                    if lines:
                        break  # its turn comes first in the next batch
                    if not skip_long:
                        raise OverLimit(f"the line at byte {start} of {EVENTS_FILE} is longer than "
                                        f"the trainer reads ({max_line_bytes} bytes, "
                                        f"{_setting('max_event_line_bytes')})")
                    rest, ended = bounded.skip_line(f)
                    if not ended:
                        break
                    line, length = b"", length + rest
                elif not line.endswith(b"\n"):
                    break
                if until is not None and start + length > until:
                    break
                lines.append(line)
                held += len(line)
                offset = start + length
    except FileNotFoundError:
        return [], offset
    return lines, offset


def find_event(job_dir: Path, offset: int, kind: str,
               max_line_bytes: int = DEFAULT_LIMITS.max_event_line_bytes) -> int | None:
    """The offset just after the first complete line of this kind from ``offset``, if any (an
    over-long line is passed over: it is not the trainer's)."""
    try:
        with nofollow.open_read(job_dir / EVENTS_FILE) as f:
            f.seek(offset)
            for line, length in _event_lines(f, max_line_bytes):
                offset += length
                try:
                    if line and json.loads(line).get("kind") == kind:
                        return offset
                except (ValueError, AttributeError, RecursionError):
                    continue
    except FileNotFoundError:
        pass
    return None


def events_end(job_dir: Path, max_line_bytes: int = DEFAULT_LIMITS.max_event_line_bytes) -> tuple[int, int]:
    """(complete lines, byte offset after them) of the whole events.jsonl."""
    count = offset = 0
    try:
        with nofollow.open_read(job_dir / EVENTS_FILE) as f:
            for _line, length in _event_lines(f, max_line_bytes):
                count += 1
                offset += length
    except FileNotFoundError:
        pass
    return count, offset


def append_event(job_dir: Path, kind: str, **fields: Any) -> int:
    """Add one of the trainer's own events (queued, cancelled, failed) to the job's event log; returns
    the offset just after it. One write() with O_APPEND: it cannot interleave with a line the program
    appends at the same time."""
    line = (json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n").encode()
    path = job_dir / EVENTS_FILE
    # Never through a link the job planted; created (rarely: the job removed it) as the job's.
    return nofollow.append(path, line, owner=nofollow.owner_of(path))


def checkpoints(job_dir: Path, newest: int | None = None) -> list[tuple[int, str, float]]:
    """(step, path relative to the job directory, mtime) of each finished checkpoint, oldest first;
    only the ``newest`` ones when given (a job's code may make a million folders: only those kept
    are held). The program renames a checkpoint into place when complete, so a matching name is
    complete."""
    found: list[tuple[int, str, float]] = []
    try:
        with os.scandir(job_dir / CHECKPOINTS_DIR) as it:
            for entry in it:
                step = checkpoint_step(entry.name)
                if step is None or not entry.is_dir(follow_symlinks=False):
                    continue
                mtime = entry.stat(follow_symlinks=False).st_mtime
                item = (step, f"{CHECKPOINTS_DIR}/{entry.name}", mtime)
                if newest is None or len(found) < newest:
                    heapq.heappush(found, item)
                elif newest > 0:
                    heapq.heappushpop(found, item)
    except OSError:
        return []
    return sorted(found)


# --- logs ------------------------------------------------------------------------------------------
def log_path(job_dir: Path, launcher: str, run_id: str) -> Path:
    """Where a run's output goes: the job's control directory, which its code cannot write."""
    return control_dir(job_dir) / log_name(launcher, run_id)


def log_files(job_dir: Path) -> list[Path]:
    """One log per allocation, in the order they ran (Slurm ids and local run ids both increase)."""
    logs = []
    try:
        with os.scandir(control_dir(job_dir)) as it:
            entries = list(it)
    except OSError:
        return []
    for entry in entries:
        match = _LOG_NAME.match(entry.name)
        if match and entry.is_file(follow_symlinks=False):
            run = match.group(2)
            mtime = entry.stat(follow_symlinks=False).st_mtime
            logs.append(((int(run) if run.isdigit() else 0, run, mtime), Path(entry.path)))
    return [path for _, path in sorted(logs, key=lambda item: (item[0][2], item[0][0], item[0][1]))]


def _raw_lines(path: Path, max_line_bytes: int) -> Iterator[bytes]:
    """The log's lines, one longer than ``max_line_bytes`` cut there and noted as cut."""
    try:
        with nofollow.open_read(path) as f:
            while True:
                line, too_long = bounded.read_line(f, max_line_bytes)
                if not line:
                    return
                if too_long:
                    rest, ended = bounded.skip_line(f)
                    length = len(line) + rest - int(ended)  # its newline not counted
                    line = line[:max_line_bytes] + (f" [... line cut: {length} bytes, the log shows "
                             f"{max_line_bytes} ({_setting('max_log_line_bytes')})]").encode()
                yield line
    except OSError:
        return


def log_lines(job_dir: Path, start: int, limit: int,
              max_line_bytes: int = DEFAULT_LIMITS.max_log_line_bytes) -> Iterator[tuple[int, str]]:
    """(line number, text) of the stitched logs from line ``start``, at most ``limit`` lines, each
    at most ``max_line_bytes`` of the log (and a note where it was cut)."""
    number = 0
    for path in log_files(job_dir):
        for raw in _raw_lines(path, max_line_bytes):
            if number >= start:
                if limit <= 0:
                    return
                limit -= 1
                yield number, raw.decode("utf-8", errors="replace").rstrip("\n")
            number += 1


def log_tail(job_dir: Path, max_chars: int = 2000) -> str:
    """The end of the newest log, for an error message."""
    logs = log_files(job_dir)
    if not logs:
        return ""
    try:
        with nofollow.open_read(logs[-1]) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - max_chars))
            return f.read().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


def remove(job_dir: Path) -> None:
    # rmtree removes links, never what they point to.
    shutil.rmtree(job_dir, ignore_errors=True)
    shutil.rmtree(control_dir(job_dir), ignore_errors=True)
