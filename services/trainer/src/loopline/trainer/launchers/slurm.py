"""Slurm through its command-line tools (pyslurm does not build against the Slurm we target).

Finished jobs: ``squeue -t all`` lists every job the controller still remembers (``MinJobAge``,
5 minutes by default); for older ones we ask ``sacct``, which answers only where slurmdbd runs.
A job neither knows is GONE: it ended long ago, and the job directory says how.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
from collections.abc import Collection

from loopline.common.contracts.job_env import job_environment
from loopline.common.contracts.job_layout import ENTRYPOINT_FILE
from loopline.trainer import jobdir
from loopline.trainer.launchers import LauncherError, LaunchSpec, LaunchState

# squeue's NAME column wide enough for a job hash (64 hex digits).
JOB_NAME_WIDTH = 64

COMMAND_TIMEOUT_S = 30
# Slurm sends SIGTERM this long before the time limit: the program checkpoints and exits.
SIGNAL_LEAD_S = 60

_STATES = {
    "PENDING": LaunchState.PENDING,
    "CONFIGURING": LaunchState.PENDING,
    "REQUEUED": LaunchState.PENDING,
    "REQUEUE_HOLD": LaunchState.PENDING,
    "REQUEUE_FED": LaunchState.PENDING,
    "RESV_DEL_HOLD": LaunchState.PENDING,
    "RUNNING": LaunchState.RUNNING,
    # Processes may still be exiting (and writing the job directory) while a job completes.
    "COMPLETING": LaunchState.RUNNING,
    "SUSPENDED": LaunchState.RUNNING,
    "STOPPED": LaunchState.RUNNING,
    "RESIZING": LaunchState.RUNNING,
    "SIGNALING": LaunchState.RUNNING,
    "STAGE_OUT": LaunchState.RUNNING,
    "COMPLETED": LaunchState.DONE,
    "CANCELLED": LaunchState.CANCELLED,
    "FAILED": LaunchState.FAILED,
    "OUT_OF_MEMORY": LaunchState.FAILED,
    "BOOT_FAIL": LaunchState.FAILED,
    "DEADLINE": LaunchState.FAILED,
    "SPECIAL_EXIT": LaunchState.FAILED,
    "NODE_FAIL": LaunchState.PREEMPTED,
    "PREEMPTED": LaunchState.PREEMPTED,
    "TIMEOUT": LaunchState.PREEMPTED,
    "REVOKED": LaunchState.PREEMPTED,
}


def parse_state(text: str) -> LaunchState:
    # sacct writes "CANCELLED by 0"; squeue the bare name.
    word = text.strip().split(" ", 1)[0].upper()
    return _STATES.get(word, LaunchState.UNKNOWN)


def time_limit_minutes(seconds: int) -> int:
    """Slurm's --time in whole minutes, leaving room for the SIGTERM lead."""
    return max(1, math.ceil((seconds + SIGNAL_LEAD_S) / 60))


def gpus_in_gres(gres: str) -> int:
    """GPUs in a node's Gres, e.g. ``gpu:4``, ``gpu:a100:2(S:0-1),gpu:v100:1``, ``(null)``."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


class SlurmLauncher:
    name = "slurm"

    def __init__(self, partition: str | None = None, extra_args: str = "", job_env_allow: str = ""):
        self.partition = partition
        self.extra_args = shlex.split(extra_args)
        self.job_env_allow = job_env_allow
        self._gpus: int | None = None

    def _run(self, *argv: str, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, env=env,
                                 timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LauncherError(f"{argv[0]} failed: {exc}") from exc
        if check and out.returncode != 0:
            raise LauncherError(f"{' '.join(argv[:2])} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def rank_command(self, ranks: int, argv: list[str]) -> list[str]:
        if ranks <= 1:
            return argv
        # One task per rank inside the allocation; one failing rank ends the others. --export=ALL:
        # the steps get the entrypoint's environment (already the allowlist, plus LOOPLINE_JOB_DIR
        # and MASTER_*), not only the names sbatch's --export gave (srun reads SLURM_EXPORT_ENV).
        return ["srun", f"--ntasks={ranks}", "--kill-on-bad-exit=1", "--export=ALL", *argv]

    def submit(self, spec: LaunchSpec) -> str:
        # sbatch itself runs with the job's environment only (the allowlist, URLs without
        # credentials), and exports exactly those names: the job never sees the trainer's secrets,
        # and sbatch never had them to pass on. SLURM_* variables always go (SLURM_CONF among them).
        env = job_environment(os.environ, self.job_env_allow)
        argv = [
            "sbatch", "--parsable",
            f"--export={','.join(sorted(env))}",
            f"--job-name={spec.job_hash}",
            f"--chdir={spec.job_dir}",
            # One output file per allocation; the trainer's logs endpoint stitches them in order.
            # Slurm opens it as the submitting user, following links: so in the job's control
            # directory, which the job's own code cannot write.
            f"--output={jobdir.log_path(spec.job_dir, self.name, '%j')}",
            "--open-mode=append",
            # B: signal the batch shell only, which is the exec'd program (or srun, which passes
            # it on to the ranks), not every process of the job.
            f"--signal=B:TERM@{SIGNAL_LEAD_S}",
            f"--time={time_limit_minutes(spec.time_limit_s)}",
            f"--ntasks={spec.ranks}",
            # We resubmit ourselves (from the last checkpoint); Slurm must not run it twice.
            "--no-requeue",
        ]
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if self._cluster_gpus() > 0:
            argv.append("--gpus-per-task=1")
        argv += [*self.extra_args, str(jobdir.control_dir(spec.job_dir) / ENTRYPOINT_FILE)]
        out = self._run(*argv, env=env)
        # --parsable prints "id" or "id;cluster".
        run_id = out.stdout.strip().split(";", 1)[0]
        if not run_id.isdigit():
            raise LauncherError(f"sbatch printed no job id: {out.stdout!r} {out.stderr!r}")
        return run_id

    def states(self, ids: list[str]) -> dict[str, LaunchState]:
        if not ids:
            return {}
        out = self._run("squeue", "-h", "-t", "all", "-o", "%i|%T")
        known: dict[str, LaunchState] = {}
        for line in out.stdout.splitlines():
            run_id, _, state = line.strip().partition("|")
            known[run_id] = parse_state(state)
        result = {i: known[i] for i in ids if i in known}
        missing = [i for i in ids if i not in known]
        if missing:
            result.update(self._sacct(missing))
        return result

    def _sacct(self, ids: list[str]) -> dict[str, LaunchState]:
        """Jobs the controller forgot: sacct knows them if accounting runs, else they are GONE."""
        out = self._run("sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ids), check=False)
        found: dict[str, LaunchState] = {}
        if out.returncode == 0:
            for line in out.stdout.splitlines():
                run_id, _, state = line.strip().partition("|")
                found[run_id] = parse_state(state)
        return {i: found.get(i, LaunchState.GONE) for i in ids}

    def state(self, run_id: str) -> LaunchState:
        return self.states([run_id])[run_id]

    def cancel(self, run_id: str) -> None:
        # scancel sends SIGTERM, then SIGKILL after KillWait; an ended job is not an error.
        out = self._run("scancel", run_id, check=False)
        ended = "Invalid job id" in out.stderr or "already completing" in out.stderr
        if out.returncode != 0 and not ended:
            raise LauncherError(f"scancel {run_id} failed: {out.stderr.strip()}")

    def find(self, job_hash: str) -> str | None:
        out = self._run("squeue", "-h", "-n", job_hash, "-o", "%i|%T")
        for line in out.stdout.splitlines():
            run_id, _, state = line.strip().partition("|")
            if parse_state(state).alive:
                return run_id
        return None

    def queue_text(self, jobs: Collection[str] | None = None) -> str:
        if jobs is None:
            return self._run("squeue").stdout
        # squeue's default columns with the name in full (a job hash: the default cuts it to 8),
        # kept to the named jobs here rather than by `-n`, which one argument of 128 KiB bounds.
        out = self._run("squeue", "-o", f"%.18i %.9P %.{JOB_NAME_WIDTH}j %.8u %.2t %.10M %.6D %R").stdout
        header, *rows = out.splitlines() or [""]
        wanted = set(jobs)
        kept = [row for row in rows if (cols := row.split())[2:3] and cols[2] in wanted]
        return "\n".join([header, *kept]) + "\n"

    def cluster_info(self) -> tuple[int, int]:
        out = self._run("scontrol", "show", "nodes", "-o")
        nodes = gpus = 0
        for line in out.stdout.splitlines():
            if not line.startswith("NodeName="):
                continue
            nodes += 1
            match = re.search(r"(?:^|\s)Gres=(\S+)", line)
            if match:
                gpus += gpus_in_gres(match.group(1))
        self._gpus = gpus
        return gpus, nodes

    def _cluster_gpus(self) -> int:
        if self._gpus is None:
            try:
                self.cluster_info()
            except LauncherError:
                return 0
        return self._gpus or 0
