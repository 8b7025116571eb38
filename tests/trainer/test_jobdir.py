"""The job directory: code unpacking that cannot escape, event and log reading, the entrypoint,
and the model path rules."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import tarfile

import pytest

from loopline.common.contracts.job_layout import (
    CHECKPOINTS_DIR,
    CODE_DIR,
    ENTRYPOINT_FILE,
    EVENTS_FILE,
    STATUS_FILE,
    checkpoint_name,
)
from loopline.trainer import jobdir
from loopline.trainer.errors import InvalidRequest
from loopline.trainer.models import resolve_model_path


def make_tar(path, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for info, content in members:
            info.size = len(content) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(content) if info.isreg() else None)


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


def test_code_is_unpacked_under_ml(tmp_path):
    tar = tmp_path / "code.tar"
    make_tar(tar, [(entry("ml", tarfile.DIRTYPE), b""), (entry("ml/pkg/__init__.py"), b"X = 1\n"),
                   (entry("./ml/run.py"), b"print(1)\n")])
    job = tmp_path / "job"
    job.mkdir()
    jobdir.extract_code(tar, job, max_bytes=1000)
    assert (job / "ml/pkg/__init__.py").read_text() == "X = 1\n"
    assert (job / "ml/run.py").exists()


def test_unpacked_code_keeps_no_owner_or_special_bits_from_the_archive(tmp_path):
    """As root, tarfile's own extraction (without the "data" filter, which Debian bookworm's
    Python 3.11.2 lacks) would chown to the archive's uid and keep a set-uid bit."""
    tar = tmp_path / "code.tar"
    setuid = entry("ml/tool")
    setuid.mode, setuid.uid, setuid.gid, setuid.mtime = 0o4777, 0, 0, 1
    shared = entry("ml/data.txt")
    shared.mode, shared.uid, shared.gid = 0o666, 4242, 4242
    make_tar(tar, [(setuid, b"#!/bin/sh\n"), (shared, b"d"), (entry("ml/sub", tarfile.DIRTYPE), b"")])
    job = tmp_path / "job"
    job.mkdir()
    jobdir.extract_code(tar, job, max_bytes=1000)
    me = (os.getuid(), os.getgid())
    for name, mode in (("ml/tool", 0o755), ("ml/data.txt", 0o644), ("ml/sub", 0o755)):
        info = (job / name).lstat()
        assert stat.S_IMODE(info.st_mode) & ~0o022 == mode & ~0o022, (name, oct(info.st_mode))
        assert not info.st_mode & (stat.S_ISUID | stat.S_ISGID | 0o002), (name, oct(info.st_mode))
        assert (info.st_uid, info.st_gid) == me, name
    assert (job / "ml/tool").lstat().st_mtime > 1


def test_a_member_named_twice_is_refused(tmp_path):
    tar = tmp_path / "code.tar"
    make_tar(tar, [(entry("ml/a.py"), b"first"), (entry("ml/a.py"), b"second")])
    job = tmp_path / "job"
    job.mkdir()
    with pytest.raises(InvalidRequest, match="cannot be unpacked"):
        jobdir.extract_code(tar, job, max_bytes=1000)
    assert (job / "ml/a.py").read_bytes() == b"first"


@pytest.mark.parametrize("member", [
    entry("ml/../../outside.py"),
    entry("/etc/cron.d/evil"),
    entry("ml/link", tarfile.SYMTYPE, "/etc/passwd"),
    entry("ml/rel", tarfile.SYMTYPE, "../../outside"),
    entry("ml/hard", tarfile.LNKTYPE, "/etc/passwd"),
    entry("ml/dev", tarfile.CHRTYPE),
    entry("ml/fifo", tarfile.FIFOTYPE),
    entry("elsewhere/x.py"),
], ids=["dotdot", "absolute", "symlink-abs", "symlink-rel", "hardlink", "device", "fifo", "not-ml"])
def test_unsafe_code_archives_are_refused(tmp_path, member):
    tar = tmp_path / "code.tar"
    make_tar(tar, [(entry("ml/ok.py"), b"ok"), (member, b"x")])
    job = tmp_path / "a" / "b" / "job"
    job.mkdir(parents=True)
    with pytest.raises(InvalidRequest):
        jobdir.extract_code(tar, job, max_bytes=1000)
    assert list(job.iterdir()) == []  # checked before anything is written
    assert not (tmp_path / "a" / "outside.py").exists()


def test_code_archives_are_capped(tmp_path):
    tar = tmp_path / "code.tar"
    make_tar(tar, [(entry("ml/big.bin"), b"x" * 2000)])
    with pytest.raises(InvalidRequest, match="more than 1000 bytes"):
        jobdir.extract_code(tar, tmp_path, max_bytes=1000)
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(InvalidRequest):
        jobdir.extract_code(tmp_path / "junk.tar", tmp_path, max_bytes=1000)


def test_events_are_read_by_complete_lines(tmp_path):
    assert jobdir.read_events(tmp_path, 0, 10) == ([], 0)
    jobdir.append_event(tmp_path, "queued")
    (tmp_path / EVENTS_FILE).open("ab").write(b'{"kind": "started"}\n{"kind": "pro')
    lines, offset = jobdir.read_events(tmp_path, 0, 10)
    assert len(lines) == 2 and lines[1] == b'{"kind": "started"}\n'
    assert jobdir.read_events(tmp_path, offset, 10) == ([], offset)
    assert jobdir.events_end(tmp_path) == (2, offset)
    first, after_first = jobdir.read_events(tmp_path, 0, 1)
    assert len(first) == 1 and jobdir.read_events(tmp_path, after_first, 10)[1] == offset


def test_logs_are_stitched_across_allocations(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    control = jobdir.make_control_dir(job_dir)
    first, second = control / jobdir.log_name("slurm", "9"), control / jobdir.log_name("slurm", "10")
    assert first == jobdir.log_path(job_dir, "slurm", "9")
    first.write_text("a\nb\n")
    second.write_text("c\n")
    os.utime(first, (1, 1))  # the earlier allocation's log stopped changing earlier
    (control / "other.out").write_text("not a log\n")
    (job_dir / jobdir.log_name("local", "1")).write_text("the job's own file, not a log\n")
    assert list(jobdir.log_lines(job_dir, 0, 100)) == [(0, "a"), (1, "b"), (2, "c")]
    assert list(jobdir.log_lines(job_dir, 1, 1)) == [(1, "b")]
    assert jobdir.log_tail(job_dir) == "c"


def test_the_entrypoint_runs_the_command_in_the_job_dir(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    show = 'echo "$PWD|$LOOPLINE_JOB_DIR|$PYTHONPATH|$SECRET|$1"'
    path = jobdir.write_entrypoint(job_dir, ["sh", "-c", show, "x", "it's"], user_code=True,
                                   secret_env={"SECRET": "pw'd"})
    assert path == jobdir.control_dir(job_dir) / ENTRYPOINT_FILE and not (job_dir / ENTRYPOINT_FILE).exists()
    out = subprocess.run([str(path)], stdout=subprocess.PIPE, text=True,
                         env={"PATH": os.environ["PATH"]}, cwd="/", check=True).stdout
    assert out.strip() == f"{job_dir}|{job_dir}|{job_dir}/{CODE_DIR}|pw'd|it's"
    # The credential is in a file only the trainer reads, not in the script.
    secret = jobdir.control_dir(job_dir) / jobdir.SECRET_ENV_FILE
    assert "pw" not in path.read_text() and (secret.stat().st_mode & 0o777) == 0o600
    assert (path.stat().st_mode & 0o777) == 0o700
    assert (jobdir.control_dir(job_dir).stat().st_mode & 0o777) == 0o700
    jobdir.write_entrypoint(job_dir, ["srun", "--ntasks=2", "python", "-m", "x"], user_code=False)
    text = path.read_text()
    assert "PYTHONPATH" not in text and "MASTER_ADDR" in text and "exec srun --ntasks=2" in text
    assert not secret.exists()


def assert_replaced_not_followed(job_dir, outside):
    """The trainer's event goes into a fresh events.jsonl, not through what was planted there."""
    jobdir.append_event(job_dir, "cancelled")
    events = job_dir / EVENTS_FILE
    assert not events.is_symlink() and os.stat(events).st_nlink == 1
    assert [json.loads(line)["kind"] for line in jobdir.read_events(job_dir, 0, 10)[0]] == ["cancelled"]
    events.unlink()


def test_no_file_of_the_job_dir_is_followed_through_a_link(tmp_path):
    """Links, FIFOs and hard links a job's code planted read as missing and are never written
    through; the file they point to is unchanged."""
    job_dir, outside = tmp_path / "job", tmp_path / "marker"
    job_dir.mkdir()
    outside.write_text('{"kind": "started", "secret": 1}\n')
    for name in (EVENTS_FILE, STATUS_FILE):
        (job_dir / name).symlink_to(outside)
    assert jobdir.read_status(job_dir) is None
    assert jobdir.read_events(job_dir, 0, 10) == ([], 0) and jobdir.events_end(job_dir) == (0, 0)
    assert jobdir.find_event(job_dir, 0, "started") is None
    assert_replaced_not_followed(job_dir, outside)
    (job_dir / STATUS_FILE).unlink()
    (job_dir / STATUS_FILE).symlink_to(outside)
    jobdir.mark_requeued(job_dir)  # reads nothing through the link, so writes nothing either
    os.mkfifo(job_dir / EVENTS_FILE)
    assert jobdir.read_events(job_dir, 0, 10) == ([], 0)  # does not block either
    assert_replaced_not_followed(job_dir, outside)
    os.link(outside, job_dir / EVENTS_FILE)  # a hard link (fs.protected_hardlinks=0 allows others')
    assert jobdir.read_events(job_dir, 0, 10) == ([], 0)
    assert_replaced_not_followed(job_dir, outside)
    assert outside.read_text() == '{"kind": "started", "secret": 1}\n'
    # A log "of the job" planted in the job's own folder is not a log at all.
    (job_dir / jobdir.log_name("slurm", "1")).symlink_to(outside)
    control = jobdir.make_control_dir(job_dir)
    (control / jobdir.log_name("slurm", "2")).symlink_to(outside)
    assert list(jobdir.log_lines(job_dir, 0, 10)) == [] and jobdir.log_tail(job_dir) == ""


def test_the_atomic_writer_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    from loopline.common.atomic_files import write_atomic

    outside = tmp_path / "marker"
    outside.write_text("keep")
    (tmp_path / ENTRYPOINT_FILE).symlink_to(outside)
    write_atomic(tmp_path / ENTRYPOINT_FILE, "new", mode=0o700)
    assert outside.read_text() == "keep" and (outside.stat().st_mode & 0o777) != 0o700
    assert not (tmp_path / ENTRYPOINT_FILE).is_symlink()
    assert (tmp_path / ENTRYPOINT_FILE).read_text() == "new"
    assert ((tmp_path / ENTRYPOINT_FILE).stat().st_mode & 0o777) == 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ENTRYPOINT_FILE, "marker"])


def test_status_is_marked_queued_before_a_restart(tmp_path):
    (tmp_path / STATUS_FILE).write_text('{"status": "FAILED", "error": "boom", "step": 7}')
    jobdir.mark_requeued(tmp_path)
    status = jobdir.read_status(tmp_path)
    assert (status["status"], status["error"], status["step"]) == ("QUEUED", None, 7)


def test_model_paths_follow_resolve_model_without_torch(tmp_path):
    models = tmp_path / "models"
    (models / "SmolLM2-135M-Instruct").mkdir(parents=True)
    local = tmp_path / "my-model"
    local.mkdir()
    assert resolve_model_path(str(local), models) == str(local)
    smollm2 = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", models)
    assert smollm2 == str(models / "SmolLM2-135M-Instruct")
    assert resolve_model_path("tiny", models) == "tiny"  # not built yet: the program resolves it
    (models / "tiny").mkdir()
    assert resolve_model_path("loopline/tiny", models) == str(models / "tiny")
    assert resolve_model_path("org/unknown-model", models) == "org/unknown-model"


# --- what a job writes is read with a bound ---------------------------------------------------------
GiB = 1024 ** 3


def sparse_append(path, size: int, then: bytes = b"") -> None:
    """``size`` zero bytes (a hole: no disk, no reading) with no newline at the end of ``path``,
    then ``then``."""
    with open(path, "ab") as f:
        f.truncate(f.seek(0, os.SEEK_END) + size)
        f.seek(0, os.SEEK_END)
        f.write(then)


def test_a_status_over_its_limit_is_refused_without_being_read(tmp_path):
    (tmp_path / STATUS_FILE).write_text(json.dumps({"status": "TRAINING", "step": 3}))
    assert jobdir.read_status(tmp_path, max_bytes=1024) == {"status": "TRAINING", "step": 3}
    sparse_append(tmp_path / STATUS_FILE, 64 * GiB)
    with pytest.raises(jobdir.OverLimit, match="LOOPLINE_MAX_STATUS_BYTES"):
        jobdir.read_status(tmp_path, max_bytes=1024)
    # A restart starts from a bare QUEUED rather than reading it.
    jobdir.mark_requeued(tmp_path, max_bytes=1024)
    assert jobdir.read_status(tmp_path, max_bytes=1024)["status"] == "QUEUED"
    (tmp_path / STATUS_FILE).write_text("[" * 100_000 + "]" * 100_000)  # deeper than json goes
    assert jobdir.read_status(tmp_path) is None


def test_an_events_line_over_its_limit_stops_the_reading_and_is_passed_over_at_the_end(tmp_path):
    jobdir.append_event(tmp_path, "queued")
    first, after_first = jobdir.read_events(tmp_path, 0, 10, max_line_bytes=1024)
    assert len(first) == 1
    jobdir.append_event(tmp_path, "started")
    sparse_append(tmp_path / EVENTS_FILE, 64 * GiB)  # a line of 64 GiB, no newline
    # The line before it is read; at the long one the reading stops, having held 1 KiB of it.
    lines, offset = jobdir.read_events(tmp_path, after_first, 10, max_line_bytes=1024)
    assert [json.loads(line)["kind"] for line in lines] == ["started"]
    with pytest.raises(jobdir.OverLimit, match="LOOPLINE_MAX_EVENT_LINE_BYTES"):
        jobdir.read_events(tmp_path, offset, 10, max_line_bytes=1024)
    # The trainer's own last line is a line of its own after it, found across the hole at once.
    end = jobdir.append_event(tmp_path, "failed", error="too long")
    assert jobdir.find_event(tmp_path, offset, "failed", max_line_bytes=1024) == end
    lines, last = jobdir.read_events(tmp_path, offset, 10, until=end, max_line_bytes=1024, skip_long=True)
    assert lines[0] == b"" and json.loads(lines[1])["kind"] == "failed" and last == end
    assert jobdir.events_end(tmp_path, max_line_bytes=1024) == (4, end)


def test_a_log_line_over_its_limit_is_cut_with_a_note_and_the_next_lines_keep_their_numbers(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    log = jobdir.log_path(job_dir, "local", "1")
    jobdir.make_control_dir(job_dir)
    log.write_bytes(b"first\n" + b"x" * 5000 + b"\n")
    sparse_append(log, 64 * GiB, b"still the third line\nfourth\n")
    lines = list(jobdir.log_lines(job_dir, 0, 10, max_line_bytes=1000))
    assert [n for n, _ in lines] == [0, 1, 2, 3] and lines[0][1] == "first" and lines[3][1] == "fourth"
    assert lines[1][1].startswith("x" * 1000 + " [... line cut: 5000 bytes")
    assert "LOOPLINE_MAX_LOG_LINE_BYTES" in lines[1][1]
    assert lines[2][1].startswith("\0" * 1000 + f" [... line cut: {64 * GiB + 20} bytes")
    assert list(jobdir.log_lines(job_dir, 3, 10, max_line_bytes=1000)) == [(3, "fourth")]


def test_only_the_newest_checkpoints_are_kept_when_asked(tmp_path):
    for step in (5, 1, 9, 3):
        (tmp_path / CHECKPOINTS_DIR / checkpoint_name(step)).mkdir(parents=True)
    assert [step for step, _, _ in jobdir.checkpoints(tmp_path, newest=2)] == [5, 9]
    assert [step for step, _, _ in jobdir.checkpoints(tmp_path)] == [1, 3, 5, 9]
