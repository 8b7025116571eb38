"""A job's own ml/ code, run by the real trainer as root over real Slurm and the local launcher,
attacks as issue 23 found it could: it plants links in its job directory to a root-only marker file
(its logs, events.jsonl, status.json, the entrypoint and its old temporary names), tries to write
the trainer's control folder, and tries to read another job's dataset and a session worker's NATS
credential. None succeeds: the marker is never written, chmod-ed or read back through the logs
route, the other job's data and the credential stay unread, and the trainer still ends the job
(its final event written into a fresh events.jsonl, not through the link).

The code gets in the way ScalarLM's shipped code does: ``ml/`` is first on PYTHONPATH, so its
``sitecustomize.py`` runs as the training program's interpreter starts (the system python here: the
job's uid must be able to run it)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.job_layout import (
    CODE_DIR,
    DATASET_FILE,
    ENTRYPOINT_FILE,
    EVENTS_FILE,
    STATUS_FILE,
)
from loopline.common.contracts.training_archive import deterministic_tar
from loopline.trainer import jobdir
from support.root import need_root

PYTHON = "/usr/bin/python3"
# The training program: an interpreter that exits 3 once the shipped sitecustomize has run.
PROGRAM = f"{PYTHON} -c 'import sys; sys.exit(3)'"
MARKER_TEXT = "MARKER: root's alone, never to be read or written for a job\n"
OTHER_DATA = b'{"input": "OTHER-TENANT-DATA", "output": " private"}\n'
WORKER_PASSWORD = "WORKER-NATS-PASSWORD"
# The names the job plants as links to the marker: what the trainer (root) or Slurm would write,
# append to, chmod or read back for it, in the job's own folder.
PLANTED = [EVENTS_FILE, STATUS_FILE, ENTRYPOINT_FILE, jobdir.log_name("local", "L1"),
           jobdir.log_name("slurm", "1"), f".{ENTRYPOINT_FILE}.tmp", f".{STATUS_FILE}.tmp",
           f".{ENTRYPOINT_FILE}.{os.getpid()}.00000000.tmp"]

ATTACK = '''
import glob, json, os, sys
job = os.environ["LOOPLINE_JOB_DIR"]
marker, other, workers = {marker!r}, {other!r}, {workers!r}
control = os.path.join(os.path.dirname(job), ".control", os.path.basename(job))
tried = {{"uid": os.getuid()}}

def attempt(name, action):
    try:
        tried[name] = ["ok", action()]
    except Exception as exc:
        tried[name] = [type(exc).__name__, str(exc)]

def plant(folder, name):
    path = os.path.join(folder, name)
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(marker, path)
    return "planted"

for name in {planted!r}:
    attempt("plant " + name, lambda: plant(job, name))
attempt("plant in control", lambda: plant(control, "local-L999.out"))
attempt("replace the entrypoint", lambda: open(os.path.join(control, "entrypoint.sh"), "a").write("id\\n"))
attempt("read the marker", lambda: open(marker).read())
attempt("list the other job", lambda: os.listdir(other))
attempt("read the other job's dataset", lambda: open(os.path.join(other, "dataset.jsonlines")).read())

def hunt():
    # Every file this uid can read under the jobs folder and every process's environment.
    found = []
    paths = glob.glob(os.path.join(os.path.dirname(job), "**"), recursive=True)
    paths += glob.glob(os.path.join(workers, "**"), recursive=True) + glob.glob("/proc/*/environ")
    for path in paths:
        try:
            with open(path, "rb") as f:
                if {backwards!r}[::-1].encode() in f.read():  # not spelled out in this file
                    found.append(path)
        except OSError:
            pass
    return found
attempt("hunt the worker credential", hunt)
attempt("read the worker's secret.env", lambda: [open(p).read() for p in glob.glob(
    os.path.join(workers, ".control", "*", "secret.env"))] or open(os.path.join(workers, ".control")).read())
with open(os.path.join(job, "attack.json"), "w") as out:
    json.dump(tried, out)
print("attack done", flush=True)
'''


@pytest.fixture
def jobs_dir():
    """Jobs under a folder every user may pass through (pytest's tmp folders are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="loopline-box-"))
    folder.chmod(0o755)
    yield folder / "jobs"
    shutil.rmtree(folder, ignore_errors=True)


def snapshot(path: Path) -> tuple:
    info = path.lstat()
    return path.read_text(), stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid, info.st_mtime_ns


async def log_text(client, job_hash: str) -> str:
    reply = await client.call(subjects.SVC_TRAINER_LOGS, {"job": job_hash, "limit": 10_000})
    return "\n".join(line["line"] for line in reply["lines"])


async def test_user_code_cannot_use_the_trainer_or_reach_other_jobs(launcher_kind, start_trainer, client,
                                                                    jobs_dir, nats_url, tmp_path):
    need_root()
    assert os.access(PYTHON, os.X_OK), f"{PYTHON} runs the shipped code"
    # Root's alone, like /etc/shadow: the job cannot read it itself.
    marker = tmp_path / "marker.txt"
    marker.write_text(MARKER_TEXT)
    marker.chmod(0o600)
    before = snapshot(marker)
    # A session worker's folders as the trainer writes them (tinker_workers._start_worker).
    worker_dir = tinker_names.worker_dir(jobs_dir, "f" * 32)
    worker_dir.parent.mkdir(parents=True)
    worker_dir.mkdir(mode=0o700)
    worker_url = f"nats://tinker-worker:{WORKER_PASSWORD}@127.0.0.1:4222"
    jobdir.write_entrypoint(worker_dir, ["true"], user_code=False,
                            secret_env={"LOOPLINE_NATS_URL": worker_url})
    await start_trainer(launcher_kind, train_command=PROGRAM, allow_user_code="true", max_resubmits=0,
                        tinker_worker_nats_url=worker_url)

    benign = deterministic_tar({f"{CODE_DIR}/sitecustomize.py": (b"", False)})
    other = await client.submit({"max_steps": 1}, dataset=OTHER_DATA, code=benign)
    other_dir = jobs_dir / other.job_hash
    code = ATTACK.format(marker=str(marker), other=str(other_dir), workers=str(worker_dir.parent),
                         planted=PLANTED, backwards=WORKER_PASSWORD[::-1])
    info = await client.submit({"max_steps": 1}, code=deterministic_tar({
        f"{CODE_DIR}/sitecustomize.py": (code.encode(), False)}))
    job_dir = jobs_dir / info.job_hash
    entrypoint = jobdir.control_dir(job_dir) / ENTRYPOINT_FILE

    # Failed on its first run (max_resubmits 0): the trainer appended its "failed" event, read the
    # status and logs. Then restarted: status.json rewritten, the entrypoint written again.
    await client.wait_status(info.job_hash, "FAILED")
    script = entrypoint.read_text()
    (job_dir / "attack.json").unlink()
    await client.call(subjects.SVC_TRAINER_RESTART, {"job": info.job_hash})
    await client.wait_status(info.job_hash, "FAILED")
    tried = json.loads((job_dir / "attack.json").read_text())

    # The attack ran, as a uid of its own, and planted every link in its own folder...
    assert tried["uid"] not in (0, (job_dir / ".." / other.job_hash).stat().st_uid)
    assert all(tried[f"plant {name}"][0] == "ok" for name in PLANTED), tried
    # ...and got nothing else.
    for name in ("plant in control", "replace the entrypoint", "read the marker", "list the other job",
                 "read the other job's dataset", "read the worker's secret.env"):
        assert tried[name][0] == "PermissionError", (name, tried[name])
    assert tried["hunt the worker credential"] == ["ok", []]
    assert "OTHER-TENANT-DATA" not in json.dumps(tried)

    # The marker: never written, chmod-ed, given away, or read back through the logs route.
    assert snapshot(marker) == before
    logs = await log_text(client, info.job_hash)
    assert "attack done" in logs and "MARKER" not in logs
    # The trainer wrote through none of the links: its event went into a fresh events.jsonl, and
    # its script is its own, in a folder the job cannot write.
    events = job_dir / EVENTS_FILE
    assert events.is_file() and not events.is_symlink()
    assert [json.loads(line)["kind"] for line in events.read_text().splitlines()][-1] == "failed"
    assert not entrypoint.is_symlink() and entrypoint.stat().st_uid == 0
    assert stat.S_IMODE(entrypoint.stat().st_mode) == 0o700 and "id\n" not in entrypoint.read_text()
    assert script == entrypoint.read_text() and WORKER_PASSWORD not in script
    # Each job's folder and dataset: its own uid's, the trainer's group, no one else's.
    for folder in (job_dir, other_dir):
        for path in (folder, folder / DATASET_FILE):
            assert path.stat().st_mode & 0o007 == 0, path
    assert job_dir.stat().st_uid != other_dir.stat().st_uid
