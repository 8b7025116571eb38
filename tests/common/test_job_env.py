"""The allowlist of what a job's environment may hold, and whom a job's own code runs as."""

from __future__ import annotations

import subprocess

import pytest

from loopline.common.contracts.job_env import (
    JobUser,
    allowed,
    job_environment,
    job_user,
    strip_url_credentials,
)
from support.root import need_root

TRAINER_ENV = {
    "PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
    "CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "WARN", "HF_HUB_OFFLINE": "1", "SLURM_CONF": "/etc/slurm.conf",
    "LOOPLINE_MODELS_DIR": "/models", "LOOPLINE_TINKER_IDLE_TTL_S": "60",
    "LOOPLINE_NATS_URL": "nats://trainer:hunter2@nats:4222,nats://tok3n@nats2:4222",
    "LOOPLINE_OTLP_ENDPOINT": "https://user:pw@collector:4318",
    # Secrets: none of these may reach a job.
    "LOOPLINE_DATABASE_URL": "postgresql://loopline:pw@db/loopline", "LOOPLINE_API_KEYS": "sk-1,sk-2",
    "HF_TOKEN": "hf_abc", "AWS_SECRET_ACCESS_KEY": "x", "PGPASSWORD": "pw", "SITE_API_KEY": "k",
    "OPENAI_API_KEYS": "k", "NATS_CREDENTIALS": "/creds",
    # Slurm's REST token (SLURM_* is otherwise allowed), and auth material of any name.
    "SLURM_JWT": "eyJhbGciOi", "GOOGLE_APPLICATION_CREDENTIALS": "/k.json", "NATS_AUTH_FILE": "/a",
    "SITE_AUTHORIZATION": "Bearer x",
    # Neither allowed nor secret: the trainer's own settings, unknown variables.
    "LOOPLINE_ALLOW_USER_CODE": "true", "LOOPLINE_LAUNCHER": "slurm", "EDITOR": "vim", "SITE_SCRATCH": "/s",
}


def test_a_job_gets_the_allowlist_and_no_secret():
    env = job_environment(TRAINER_ENV)
    assert env == {
        "PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "WARN", "HF_HUB_OFFLINE": "1",
        "SLURM_CONF": "/etc/slurm.conf", "LOOPLINE_MODELS_DIR": "/models", "LOOPLINE_TINKER_IDLE_TTL_S": "60",
        # The URLs lose their user:password@ (and a bare token@).
        "LOOPLINE_NATS_URL": "nats://nats:4222,nats://nats2:4222",
        "LOOPLINE_OTLP_ENDPOINT": "https://collector:4318",
    }


def test_an_operator_extends_the_allowlist_but_never_to_a_secret():
    env = job_environment(TRAINER_ENV, "SITE_*, EDITOR,LOOPLINE_DATABASE_URL,HF_TOKEN,SITE_API_KEY")
    assert env["SITE_SCRATCH"] == "/s" and env["EDITOR"] == "vim"
    for secret in ("LOOPLINE_DATABASE_URL", "HF_TOKEN", "SITE_API_KEY", "LOOPLINE_API_KEYS",
                   "SITE_AUTHORIZATION"):
        assert secret not in env
    assert "SLURM_JWT" not in job_environment(TRAINER_ENV, "SLURM_*,SLURM_JWT")
    assert allowed("TOKENIZERS_PARALLELISM", ["TOKENIZERS_*"])  # not a token, not denied
    assert allowed("SITE_X", ["SITE_*"]) and not allowed("SITE_X", ["SITE"])
    assert not allowed("MY_DB_PASSWORD_FILE", ["MY_*"])


def test_url_credentials_are_stripped_and_nothing_else():
    assert strip_url_credentials("nats://a:b@h:4222") == "nats://h:4222"
    assert strip_url_credentials("tls://h:4222") == "tls://h:4222"
    assert strip_url_credentials("/path/with@sign") == "/path/with@sign"
    assert strip_url_credentials("nats://h:4222/x@y") == "nats://h:4222/x@y"  # '@' after the host


def test_whom_user_code_runs_as():
    # As root: a uid of its own per job by default, one named user, or root itself (nothing dropped).
    per_job = job_user(None, euid=0)
    assert per_job is not None and (per_job.uid, per_job.count) == (200_000_000, 1_000_000)
    assert per_job.for_uid(200_000_007) == JobUser("loopline-job-200000007", 200_000_007, 200_000_007)
    assert job_user(None, euid=0, uid_range="5000-5009").count == 10
    for bad in ("5000", "0-10", "10-5", "a-b", "1-4294967295"):
        with pytest.raises(ValueError, match="JOB_UID_RANGE"):
            job_user(None, euid=0, uid_range=bad)
    nobody = job_user("nobody", euid=0)
    assert nobody is not None and (nobody.name, nobody.uid, nobody.count) == ("nobody", 65534, 1)
    assert job_user("root", euid=0) is None and job_user("0", euid=0) is None
    # Not root: the trainer's own user, and asking for another is refused at start.
    assert job_user(None, euid=1000) is None
    with pytest.raises(ValueError, match="only a trainer running as root"):
        job_user("nobody", euid=1000)
    with pytest.raises(ValueError, match="not a user"):
        job_user("no-such-user-here", euid=0)


def test_the_job_user_prefix_really_drops_privileges():
    need_root("dropping privileges needs root")
    per_job = job_user(None)
    assert per_job is not None
    user = per_job.for_uid(per_job.uid + 3)
    out = subprocess.run([*user.argv(), "sh", "-c", "id -u; id -g; id -G"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == [str(user.uid)] * 3
