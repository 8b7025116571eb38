"""The job directory: what the trainer writes for a job to run, and reads back while it runs.

The layout and its names are loopline.common.contracts.job_layout's; the trainer adds one log per allocation,
``slurm-<id>.out`` or ``local-<id>.out`` (written by the launcher). A new job's directory is staged
under a temporary name and renamed into place, so a directory under its hash is always complete.
Nothing here talks to NATS or SQL.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from loopline.common.atomic_files import replace_dir, write_atomic
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
from loopline.trainer.errors import InvalidRequest

MAX_CODE_MEMBERS = 10_000
_LOG_NAME = re.compile(r"^(slurm|local)-(.+)\.out$")


def log_name(launcher: str, run_id: str) -> str:
    """The log of one allocation in the job directory; Slurm's is named with ``%j`` for its id."""
    return f"{launcher}-{run_id}.out"


# --- writing a new job -----------------------------------------------------------------------------
def staging_dir(jobs_dir: Path, job_hash: str) -> Path:
    path = jobs_dir / f".staging-{job_hash}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


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


def write_entrypoint(job_dir: Path, argv: list[str], *, user_code: bool,
                     env: dict[str, str] | None = None, run_as: JobUser | None = None) -> None:
    """The script the launcher runs; ``argv`` is the full training command (srun included), run
    with ``env`` exported (the trainer's choice, e.g. a session worker's own NATS credential, on top
    of the launcher's allowlist of the trainer's environment). ``run_as``:
    the program in ``argv`` already drops to that user, whose HOME becomes the job directory (its
    own, e.g. /nonexistent, would fail every cache a library writes)."""
    lines = [
        "#!/usr/bin/env bash",
        "# Written by the Loopline trainer; run by sbatch or the local launcher.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(job_dir))}",
        f"export LOOPLINE_JOB_DIR={shlex.quote(str(job_dir))}",
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted((env or {}).items())]
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
    path = job_dir / ENTRYPOINT_FILE
    write_atomic(path, "\n".join(lines) + "\n")
    path.chmod(0o755)


def give_to(job_dir: Path, user: JobUser) -> None:
    """Make the job directory the job user's, so its program can write status, events and
    checkpoints there; the trainer (root) reads and appends to it still."""
    os.chown(job_dir, user.uid, user.gid)
    # Invariant: every entry above ``root`` in the walk is already the user's.
    for root, dirs, files in os.walk(job_dir):
        for name in (*dirs, *files):
            os.chown(os.path.join(root, name), user.uid, user.gid, follow_symlinks=False)


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
            # The checks above are ours; the "data" filter is the standard library's second guard.
            tar.extractall(job_dir, members=members, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise InvalidRequest(f"the code archive cannot be unpacked: {exc}") from exc


def _check_code_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if member.issym() or member.islnk():
        raise InvalidRequest(f"code archive: {name!r} is a link; links are refused")
    if not (member.isreg() or member.isdir()):
        raise InvalidRequest(f"code archive: {name!r} is not a regular file or directory")
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise InvalidRequest(f"code archive: {name!r} is an absolute or malformed path")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if ".." in parts:
        raise InvalidRequest(f"code archive: {name!r} points outside the job directory")
    if not parts or parts[0] != CODE_DIR:
        raise InvalidRequest(f"code archive: {name!r} is not under {CODE_DIR}/")


# --- reading what the program writes ---------------------------------------------------------------
def read_status(job_dir: Path) -> dict[str, Any] | None:
    try:
        status = json.loads((job_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def mark_requeued(job_dir: Path) -> None:
    """Before a restart: status.json still says FAILED (or a stale TRAINING) until the program
    rewrites it; make it QUEUED so nothing reads the old ending as the new run's."""
    status = read_status(job_dir)
    if status is None:
        return
    status.update(status="QUEUED", error=None, updated_at=time.time())
    write_atomic(job_dir / STATUS_FILE, json.dumps(status, indent=1) + "\n")


def read_events(job_dir: Path, offset: int, max_lines: int,
                until: int | None = None) -> tuple[list[bytes], int]:
    """Complete lines of events.jsonl from byte ``offset`` (a line still being written is left for
    next time), none ending past ``until``; and the offset just after the last one returned."""
    try:
        with open(job_dir / EVENTS_FILE, "rb") as f:
            f.seek(offset)
            lines: list[bytes] = []
            while len(lines) < max_lines:
                line = f.readline()
                if not line.endswith(b"\n") or (until is not None and offset + len(line) > until):
                    break
                lines.append(line)
                offset += len(line)
    except FileNotFoundError:
        return [], offset
    return lines, offset


def find_event(job_dir: Path, offset: int, kind: str) -> int | None:
    """The offset just after the first complete line of this kind from ``offset``, if any."""
    try:
        with open(job_dir / EVENTS_FILE, "rb") as f:
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    return None
                offset += len(line)
                try:
                    if json.loads(line).get("kind") == kind:
                        return offset
                except (ValueError, AttributeError):
                    continue
    except FileNotFoundError:
        pass
    return None


def events_end(job_dir: Path) -> tuple[int, int]:
    """(complete lines, byte offset after them) of the whole events.jsonl."""
    count = offset = 0
    try:
        with open(job_dir / EVENTS_FILE, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                count += 1
                offset += len(line)
    except FileNotFoundError:
        pass
    return count, offset


def append_event(job_dir: Path, kind: str, **fields: Any) -> int:
    """Add one of the trainer's own events (queued, cancelled, failed) to the job's event log; returns
    the offset just after it. One write() with O_APPEND: it cannot interleave with a line the program
    appends at the same time."""
    line = (json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n").encode()
    fd = os.open(job_dir / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        return os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND wrote at the end: this is our line's end
    finally:
        os.close(fd)


def checkpoints(job_dir: Path) -> list[tuple[int, str, float]]:
    """(step, path relative to the job directory, mtime) of each finished checkpoint, oldest first.
    The program renames a checkpoint into place when complete, so a matching name is complete."""
    found = []
    try:
        entries = list((job_dir / CHECKPOINTS_DIR).iterdir())
    except OSError:
        return []
    for entry in entries:
        step = checkpoint_step(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, f"{CHECKPOINTS_DIR}/{entry.name}", entry.stat().st_mtime))
    return sorted(found)


# --- logs ------------------------------------------------------------------------------------------
def log_files(job_dir: Path) -> list[Path]:
    """One log per allocation, in the order they ran (Slurm ids and local run ids both increase)."""
    logs = []
    try:
        entries = list(job_dir.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _LOG_NAME.match(entry.name)
        if match:
            run = match.group(2)
            logs.append(((int(run) if run.isdigit() else 0, run, entry.stat().st_mtime), entry))
    return [path for _, path in sorted(logs, key=lambda item: (item[0][2], item[0][0], item[0][1]))]


def log_lines(job_dir: Path, start: int, limit: int) -> Iterator[tuple[int, str]]:
    """(line number, text) of the stitched logs from line ``start``, at most ``limit`` lines."""
    number = 0
    for path in log_files(job_dir):
        with open(path, "rb") as f:
            for raw in f:
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
    with open(logs[-1], "rb") as f:
        f.seek(max(0, logs[-1].stat().st_size - max_chars))
        return f.read().decode("utf-8", errors="replace").strip()


def remove(job_dir: Path) -> None:
    shutil.rmtree(job_dir, ignore_errors=True)
