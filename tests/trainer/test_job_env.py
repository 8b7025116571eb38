"""What a job runs with, through the real trainer over real Slurm and the local launcher: an
allowlist of the trainer's environment (never its database URL, API keys or NATS password), its
own ml/ code as a uid of its own where the trainer is root, and Loopline's own ml/ shipped back
to it accepted as no user code at all."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from loopline.common.contracts.job_layout import CODE_DIR, DATASET_FILE, ENTRYPOINT_FILE
from loopline.common.contracts.training_archive import deterministic_tar
from loopline.common.runtime.service_client import ServiceError
from loopline.trainer.jobdir import control_dir
from loopline.trainer.shipped_code import installed_digest
from support.root import need_root

# The per-job uids a root trainer gives user code (TrainerSettings.job_uid_range's default).
FIRST_JOB_UID, JOB_UIDS = 200_000_000, 1_000_000
# The job program: it writes its own environment (as the kernel handed it over, /proc/<pid>/environ)
# and its uid into the job directory; the trainer appends "--job-dir DIR" ($1 $2).
PROBE = ("/bin/bash -c " + shlex.quote('tr "\\0" "\\n" < /proc/$$/environ > "$2/env.txt.tmp"; '
                                       'id -u > "$2/uid.txt.tmp"; mv "$2/env.txt.tmp" "$2/env.txt"; '
                                       'mv "$2/uid.txt.tmp" "$2/uid.txt"') + " probe")
SECRETS = {"LOOPLINE_API_KEYS": "sk-live-1,sk-live-2", "HF_TOKEN": "hf_secret", "SITE_DB_PASSWORD": "pw",
           "AWS_SECRET_ACCESS_KEY": "aws"}


@pytest.fixture
def jobs_dir():
    """Jobs under a folder every user may pass through (pytest's tmp folders are root's alone), so
    a job dropped to ``nobody`` can enter its directory."""
    folder = Path(tempfile.mkdtemp(prefix="loopline-jobs-"))
    folder.chmod(0o755)
    yield folder / "jobs"
    shutil.rmtree(folder, ignore_errors=True)


async def probe_result(job_dir: Path, timeout_s: float = 60.0) -> tuple[dict[str, str], int]:
    deadline = time.monotonic() + timeout_s
    while not (job_dir / "uid.txt").exists():
        assert time.monotonic() < deadline, f"the job wrote nothing in {timeout_s}s"
        await asyncio.sleep(0.1)
    lines = (job_dir / "env.txt").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    return env, int((job_dir / "uid.txt").read_text())


async def start_with_secrets(start_trainer, kind: str, nats_url: str, tmp_path: Path, monkeypatch,
                             **settings: object):
    """The trainer with a database URL, API keys, a password in its NATS URL and other secrets in
    its environment, as a production trainer has them."""
    for name, value in {**SECRETS, "SITE_SCRATCH": "/scratch"}.items():
        monkeypatch.setenv(name, value)
    # nats-server without authentication ignores the user and password the client sends.
    secret_nats = nats_url.replace("nats://", "nats://trainer:nats-password@")
    # NATS_URL: upper-cased into LOOPLINE_NATS_URL, after (so over) the fixture's own nats_url.
    await start_trainer(kind, train_command=PROBE, NATS_URL=secret_nats, job_env_allow="SITE_*",
                        database_url=f"sqlite:///{tmp_path / 'registry.db'}", **settings)


def assert_no_secrets(env: dict[str, str], job_dir: Path) -> None:
    assert "LOOPLINE_DATABASE_URL" not in env
    for name in SECRETS:
        assert name not in env, name
    everything = "\n".join(f"{k}={v}" for k, v in env.items())
    for value in ("nats-password", "registry.db", "sk-live-1", "hf_secret"):
        assert value not in everything, value
    assert env["PATH"] and env["LOOPLINE_JOB_DIR"] == str(job_dir)
    assert env["SITE_SCRATCH"] == "/scratch"  # the operator's extension of the allowlist
    assert "@" not in env.get("LOOPLINE_NATS_URL", "")


async def test_a_job_sees_an_allowlist_of_the_trainers_environment(launcher_kind, start_trainer, client,
                                                                   jobs_dir, nats_url, tmp_path,
                                                                   monkeypatch):
    await start_with_secrets(start_trainer, launcher_kind, nats_url, tmp_path, monkeypatch)
    info = await client.submit({"max_steps": 1})
    job_dir = jobs_dir / info.job_hash
    env, uid = await probe_result(job_dir)
    assert_no_secrets(env, job_dir)
    assert uid == os.geteuid()  # no user code: the trainer's own user
    if launcher_kind == "slurm":
        assert env["SLURM_JOB_ID"] == info.slurm_job_id
    else:
        assert env["LOOPLINE_RUN_ID"] == info.slurm_job_id


async def test_user_code_runs_as_a_uid_of_its_own_without_secrets(launcher_kind, start_trainer, client,
                                                                  jobs_dir, nats_url, tmp_path, monkeypatch):
    need_root()
    await start_with_secrets(start_trainer, launcher_kind, nats_url, tmp_path, monkeypatch,
                             allow_user_code="true")
    info = await client.submit({"max_steps": 1}, code=deterministic_tar({
        f"{CODE_DIR}/mine/__init__.py": (b"VALUE = 1\n", False)}))
    assert info.code_origin == "shipped"
    job_dir = jobs_dir / info.job_hash
    env, uid = await probe_result(job_dir)
    assert FIRST_JOB_UID <= uid < FIRST_JOB_UID + JOB_UIDS
    assert_no_secrets(env, job_dir)
    assert env["HOME"] == str(job_dir) and env["USER"] == f"loopline-job-{uid}"
    assert env["PYTHONPATH"].split(":")[0] == str(job_dir / CODE_DIR)
    assert f"setpriv --reuid={uid} --regid={uid}" in (control_dir(job_dir) / ENTRYPOINT_FILE).read_text()
    # Its directory and everything in it: the job's uid, the trainer's group, nobody else.
    for path in (job_dir, job_dir / DATASET_FILE, job_dir / CODE_DIR / "mine" / "__init__.py"):
        info = path.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o007) == (uid, os.getegid(), 0), path
    assert job_dir.stat().st_mode & 0o7777 == 0o2750


async def test_user_code_the_job_user_cannot_run_is_refused(start_trainer, client, jobs_dir, tmp_path):
    need_root()
    # A program in a folder only root may enter (pytest's tmp_path): a job's uid could not start it.
    program = tmp_path / "train.sh"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    await start_trainer("local", train_command=str(program), allow_user_code="true")
    with pytest.raises(ServiceError) as caught:
        await client.submit({"max_steps": 1}, code=deterministic_tar({f"{CODE_DIR}/x.py": (b"", False)}))
    assert caught.value.status == 403 and "'loopline-job', who cannot run" in caught.value.message
    assert [p.name for p in jobs_dir.iterdir() if not p.name.startswith(".")] == []


def installed_init() -> bytes:
    import loopline.ml

    return Path(loopline.ml.__file__).read_bytes()


def loopline_ml_tar(change: dict[str, bytes] | None = None) -> bytes:
    """The installed loopline.ml as the scalarlm client ships it from a Loopline checkout: the
    whole ml/ folder, package under ml/src/loopline/ml, bytecode caches and all."""
    import loopline.ml

    package = Path(loopline.ml.__file__).parent
    files = {f"{CODE_DIR}/src/loopline/ml/{p.relative_to(package).as_posix()}": (p.read_bytes(), False)
             for p in package.rglob("*") if p.is_file()}
    files[f"{CODE_DIR}/pyproject.toml"] = (b"[project]\nname = 'loopline-ml'\n", False)
    files[f"{CODE_DIR}/src/loopline/ml/__pycache__/stale.cpython-311.pyc"] = (b"\x00junk", False)
    for name, content in (change or {}).items():
        files[f"{CODE_DIR}/src/loopline/ml/{name}"] = (content, False)
    return deterministic_tar(files)


async def test_shipping_loopline_own_ml_back_is_no_user_code(start_trainer, client, jobs_dir):
    assert installed_digest() is not None
    await start_trainer("local")  # user code off
    info = await client.submit({"max_steps": 2}, code=loopline_ml_tar())
    assert info.code_origin == "installed" and info.code_sha256
    job_dir = jobs_dir / info.job_hash
    # Not unpacked, not on PYTHONPATH, not dropped to another user: the installed code runs.
    assert not (job_dir / CODE_DIR).exists()
    entrypoint = (control_dir(job_dir) / ENTRYPOINT_FILE).read_text()
    assert "PYTHONPATH" not in entrypoint and "setpriv" not in entrypoint
    await client.wait_status(info.job_hash, "COMPLETED")  # the stand-in, from the installed package

    # One byte changed, or one file added to the package: user code, refused here.
    for change in ({"__init__.py": installed_init() + b"\n"}, {"extra.py": b"print('hi')\n"}):
        with pytest.raises(ServiceError) as caught:
            await client.submit({"max_steps": 2}, code=loopline_ml_tar(change))
        assert caught.value.status == 403 and "differs from Loopline's installed" in caught.value.message
