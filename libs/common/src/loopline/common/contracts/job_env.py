"""What a training job's (or Tinker session worker's) environment may hold: an allowlist, and who
the job runs as.

The trainer's own environment holds secrets a job has no use for (the database URL, API keys, NATS
credentials); a job, and above all a job's own ``ml/`` code, gets only what a training program needs.
Both launchers build the job's environment here (the local one passes it to ``Popen``, the Slurm one
to ``sbatch``, whose ``--export=`` names the same variables), so the list is written once.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loopline.common.config.settings import TinkerWorkerSettings

# What any program needs to run: the shell's basics, locale, temp files, the Python environment.
BASE_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "TMPDIR", "LANG", "LANGUAGE",
    "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    # Hugging Face and caches: models are prepared by the trainer, the job reads them offline.
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_CACHE", "XDG_CACHE_HOME",
})
# Families of variables for the accelerator, torch and Slurm (srun inside an allocation needs
# SLURM_CONF; sbatch hands every SLURM_* variable to the job anyway).
BASE_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "TORCH_", "PYTORCH_", "NCCL_", "OMP_", "MKL_", "SLURM_")
# The LOOPLINE_* variables job programs read: a training job reads its job directory (set by its
# entrypoint) and the models folder (loopline.ml.models); a session worker reads its settings
# object, TinkerWorkerSettings. Named from that object, so a new worker setting needs no edit here.
JOB_LOOPLINE_NAMES = frozenset({"LOOPLINE_JOB_DIR", "LOOPLINE_RUN_ID", "LOOPLINE_MODELS_DIR"} | {
    (field.validation_alias if isinstance(field.validation_alias, str) else f"LOOPLINE_{name}").upper()
    for name, field in TinkerWorkerSettings.model_fields.items()
})
# Never handed to a job, whatever the allowlist or an operator's extension of it says.
DENIED_NAMES = frozenset({"LOOPLINE_DATABASE_URL", "LOOPLINE_API_KEYS"})
# Anything named like a credential: keys, tokens, passwords, secrets, JWTs (SLURM_JWT, which would
# let a job act as the trainer's Slurm user), credentials and auth material of any kind.
DENIED_PATTERN = re.compile(r"(_KEYS?$|_TOKEN$|PASSWORD|PASSWD|SECRET|CREDENTIAL|JWT|AUTH)")
# user:password@ (or token@) in a URL: nats://user:pw@host:4222, https://tok@collector
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s,]*@")


def denied(name: str) -> bool:
    upper = name.upper()
    return upper in DENIED_NAMES or DENIED_PATTERN.search(upper) is not None


def parse_allow(extra: str | Iterable[str]) -> tuple[str, ...]:
    """An operator's extension, ``"SITE_VAR,SITE_*"`` (a trailing ``*`` is a prefix), as entries."""
    items = extra.split(",") if isinstance(extra, str) else list(extra)
    return tuple(item.strip() for item in items if item.strip())


def allowed(name: str, extra: Iterable[str] = ()) -> bool:
    if denied(name):
        return False
    if name in BASE_NAMES or name in JOB_LOOPLINE_NAMES or name.startswith(BASE_PREFIXES):
        return True
    return any(name.startswith(item[:-1]) if item.endswith("*") else name == item for item in extra)


def strip_url_credentials(value: str) -> str:
    """The value with every URL's ``user:password@`` removed (each of a comma-separated list)."""
    return _URL_USERINFO.sub(r"\1", value)


def job_environment(environ: Mapping[str, str], extra: str | Iterable[str] = ()) -> dict[str, str]:
    """The part of ``environ`` a job may see: allowed names only, no credentials in URLs."""
    entries = parse_allow(extra)
    return {name: strip_url_credentials(value) for name, value in environ.items()
            if allowed(name, entries)}


# --- who the job runs as ---------------------------------------------------------------------------
# The name a per-job uid goes by in USER/LOGNAME (it has no passwd entry; nothing needs one).
PER_JOB_NAME = "loopline-job"


@dataclass(frozen=True)
class JobUser:
    """Whom a job's code runs as. ``count`` > 1: a range of uids, one per job (``uid`` is the
    first; ``for_uid`` names the one a job got), so one job's code cannot read another's files."""

    name: str
    uid: int
    gid: int
    count: int = 1

    @property
    def per_job(self) -> bool:
        return self.count > 1

    def for_uid(self, uid: int) -> JobUser:
        """This range's user with the given uid (its own group, numbered as the uid)."""
        return JobUser(f"{PER_JOB_NAME}-{uid}", uid, uid)

    def argv(self) -> list[str]:
        """The prefix that runs a program as this user (util-linux's setpriv: no PAM, no login
        shell, the environment kept as the entrypoint built it), with no supplementary groups."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"]


def parse_uid_range(text: str) -> tuple[int, int]:
    """``"200000000-200999999"`` as (first uid, count)."""
    first, sep, last = text.partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        low = high = -1
    if not sep or low <= 0 or high < low or high >= 2**32 - 1:
        raise ValueError(f"LOOPLINE_JOB_UID_RANGE={text!r} is not a range of uids like 200000000-200999999")
    return low, high - low + 1


def job_user(setting: str | None, euid: int | None = None, uid_range: str = "200000000-200999999",
             ) -> JobUser | None:
    """Whom a job's own ml/ code runs as: ``setting`` when given (every job as that one user);
    else, when the trainer runs as root, a uid of its own per job from ``uid_range``; None when it
    runs as the trainer's user (not root, or ``root`` asked)."""
    euid = os.geteuid() if euid is None else euid
    if setting is None and euid == 0:
        first, count = parse_uid_range(uid_range)
        return JobUser(PER_JOB_NAME, first, first, count)
    if setting is None:
        return None
    try:
        entry = pwd.getpwuid(int(setting)) if setting.isdigit() else pwd.getpwnam(setting)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"LOOPLINE_JOB_USER={setting!r} is not a user on this machine") from exc
    if entry.pw_uid == euid:
        return None  # already that user: nothing to drop
    if euid != 0:
        raise ValueError(f"LOOPLINE_JOB_USER={setting!r}: only a trainer running as root can run jobs as "
                         "another user")
    return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
