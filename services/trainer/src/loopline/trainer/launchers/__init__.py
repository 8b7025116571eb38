"""Launchers start a job's entrypoint somewhere and answer whether it still runs.

Two implementations share one interface: ``SlurmLauncher`` (sbatch/squeue/scancel through the Slurm
CLI) and ``LocalLauncher`` (a process per job on this machine, for laptops without Slurm). Their
methods block (subprocess calls): the service calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol


class LaunchState(str, Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    DONE = "DONE"            # ended with exit status 0
    FAILED = "FAILED"        # ended with an error (non-zero exit, node failure, out of memory)
    CANCELLED = "CANCELLED"  # cancelled (by us or by someone with scancel)
    PREEMPTED = "PREEMPTED"  # stopped by the scheduler: preemption, time limit, requeue
    GONE = "GONE"            # the launcher answered and has no record of it (purged long ago)
    UNKNOWN = "UNKNOWN"      # the launcher could not answer (controller down): decide nothing

    @property
    def alive(self) -> bool:
        return self in (LaunchState.PENDING, LaunchState.RUNNING)

    @property
    def ended(self) -> bool:
        """Known to run no more, so the job directory will not change any further."""
        return not self.alive and self is not LaunchState.UNKNOWN


@dataclass(frozen=True)
class LaunchSpec:
    """One run (one Slurm allocation) of a job: the job directory holds everything it needs."""

    job_hash: str
    job_dir: Path
    ranks: int  # processes; >1 runs them under srun (Slurm) or torchrun (local)
    time_limit_s: int  # SIGTERM comes before this, so the program can checkpoint


class LauncherError(RuntimeError):
    """The launcher's command failed (sbatch refused, controller unreachable)."""


class Launcher(Protocol):
    name: str

    def rank_command(self, ranks: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run as ``ranks`` processes (unchanged for one)."""

    def submit(self, spec: LaunchSpec) -> str:
        """Start the job's entrypoint.sh; returns the launcher's id for this run."""

    def states(self, ids: list[str]) -> dict[str, LaunchState]:
        """The state of each run, in one query where the launcher allows it."""

    def state(self, run_id: str) -> LaunchState:
        ...

    def cancel(self, run_id: str) -> None:
        """Ask the run to stop (SIGTERM, so it checkpoints); no error if it already ended."""

    def find(self, job_hash: str) -> str | None:
        """A live run of this job, if any: after a crash between submitting and recording it."""

    def queue_text(self, jobs: Collection[str] | None = None) -> str:
        """What is queued and running, as text for humans (``squeue``): of every job, or only of
        the ``jobs`` named (job hashes: one tenant's, gateway auth/tenancy.py)."""

    def cluster_info(self) -> tuple[int, int]:
        """(gpu count, node count)."""


def slurm_available() -> bool:
    """Slurm's tools are installed and its controller answers. Installed tools alone are not
    enough: CI machines have them without a cluster configured."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    try:
        out = subprocess.run(["scontrol", "ping"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "UP" in out.stdout


def make_launchers(choice: str, jobs_dir: Path, *, partition: str | None = None,
                   extra_args: str = "", job_env_allow: str = "") -> tuple[Launcher, dict[str, Launcher]]:
    """The launcher new runs go to, and every launcher by name (a job launched by another one
    before a restart is still followed by its own). ``auto`` is Slurm where a cluster answers.
    ``job_env_allow`` extends the allowlist of variables a job sees (loopline.common.contracts.job_env)."""
    from loopline.trainer.launchers.local import LocalLauncher
    from loopline.trainer.launchers.slurm import SlurmLauncher

    local = LocalLauncher(jobs_dir / ".local-runs", job_env_allow)
    launchers: dict[str, Launcher] = {"local": local}
    if choice == "slurm" or (choice == "auto" and slurm_available()):
        launchers["slurm"] = SlurmLauncher(partition=partition, extra_args=extra_args,
                                            job_env_allow=job_env_allow)
        return launchers["slurm"], launchers
    return local, launchers
