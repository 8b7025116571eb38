"""A process per job on this machine, with the Slurm launcher's interface (laptops, no sbatch).

Runs outlive the trainer, as Slurm jobs do: each starts in its own session, and everything needed to
follow it after a trainer restart is in a small record file (pid, process start time, job) under
``runs_dir``. A shell wrapper writes the entrypoint's exit status next to it when it ends, so the
state is known even when the trainer was not the process's parent any more.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path

from loopline.common.atomic_files import write_atomic
from loopline.common.contracts.job_env import job_environment
from loopline.common.contracts.job_layout import ENTRYPOINT_FILE
from loopline.common.local.launcher import process_start_time
from loopline.trainer import jobdir, nofollow
from loopline.trainer.launchers import LauncherError, LaunchSpec, LaunchState

# After a cancel, the run has this long to checkpoint before its processes are killed (Slurm's
# KillWait does the same).
KILL_WAIT_S = 30.0

# The wrapper ignores TERM/INT/HUP itself only through a trap (not inherited by the program, unlike
# an ignored signal), waits for the entrypoint, then records its status atomically.
_WRAPPER = ('trap ":" TERM INT HUP; "$@"; rc=$?; '
            'echo "$rc" > "$EXIT_FILE.tmp"; mv "$EXIT_FILE.tmp" "$EXIT_FILE"')


class LocalLauncher:
    name = "local"

    def __init__(self, runs_dir: Path, job_env_allow: str = ""):
        self.runs_dir = Path(runs_dir)
        self.job_env_allow = job_env_allow
        self._children: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    # --- records --------------------------------------------------------------------------------
    def _record(self, run_id: str) -> dict | None:
        try:
            return json.loads((self.runs_dir / f"{run_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def _exit_status(self, run_id: str) -> int | None:
        try:
            return int((self.runs_dir / f"{run_id}.exit").read_text().strip())
        except (OSError, ValueError):
            return None

    def _alive(self, run_id: str, record: dict) -> bool:
        alive = process_start_time(record["pid"]) == record["start"]
        child = self._children.get(run_id)
        # Our own child is a zombie once it ended, until we wait for it: reap it now.
        if not alive and child is not None and child.poll() is not None:
            self._children.pop(run_id, None)
        return alive

    # --- the interface --------------------------------------------------------------------------
    def rank_command(self, ranks: int, argv: list[str]) -> list[str]:
        if ranks <= 1:
            return argv
        # torchrun plays srun's part: one process per rank, rendezvous on this machine.
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        if argv[:2] == [sys.executable, "-m"]:
            return [*run, *argv[1:]]
        return [*run, "--no-python", *argv]

    def submit(self, spec: LaunchSpec) -> str:
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            run_id = f"L{time.time_ns() // 1000}"
            time.sleep(1e-6)  # the next id differs even on a coarse clock
        # In the job's control directory (never the job's own, where its code could plant a link).
        log_path = jobdir.log_path(spec.job_dir, self.name, run_id)
        entrypoint = jobdir.control_dir(spec.job_dir) / ENTRYPOINT_FILE
        # The allowlist of the trainer's environment, never all of it (its secrets stay here).
        env = {**job_environment(os.environ, self.job_env_allow),
               "EXIT_FILE": str(self.runs_dir / f"{run_id}.exit"), "LOOPLINE_RUN_ID": run_id}
        try:
            with nofollow.open_append(log_path) as log:
                child = subprocess.Popen(
                    ["bash", "-c", _WRAPPER, "loopline-job", "bash", str(entrypoint)],
                    cwd=spec.job_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )
        except OSError as exc:
            raise LauncherError(f"could not start {entrypoint}: {exc}") from exc
        start = process_start_time(child.pid) or ""
        record = {"pid": child.pid, "start": start, "job_hash": spec.job_hash,
                  "job_dir": str(spec.job_dir), "log": log_path.name, "submitted_at": time.time()}
        write_atomic(self.runs_dir / f"{run_id}.json", json.dumps(record))
        self._children[run_id] = child
        return run_id

    def state(self, run_id: str) -> LaunchState:
        record = self._record(run_id)
        if record is None:
            return LaunchState.GONE
        if self._alive(run_id, record):
            return LaunchState.RUNNING
        status = self._exit_status(run_id)
        if (self.runs_dir / f"{run_id}.cancelled").exists():
            return LaunchState.CANCELLED
        if status == 0:
            return LaunchState.DONE
        if status in (143, 128 + signal.SIGTERM):
            return LaunchState.PREEMPTED  # SIGTERM from outside: like a preemption
        return LaunchState.FAILED

    def states(self, ids: list[str]) -> dict[str, LaunchState]:
        return {run_id: self.state(run_id) for run_id in ids}

    def cancel(self, run_id: str) -> None:
        record = self._record(run_id)
        if record is None or not self._alive(run_id, record):
            return
        (self.runs_dir / f"{run_id}.cancelled").touch()
        self._signal(record, signal.SIGTERM)
        timer = threading.Timer(KILL_WAIT_S, self._kill_if_alive, args=(run_id, record))
        timer.daemon = True
        timer.start()

    def _kill_if_alive(self, run_id: str, record: dict) -> None:
        if self._alive(run_id, record):
            self._signal(record, signal.SIGKILL)

    @staticmethod
    def _signal(record: dict, sig: int) -> None:
        # The run is its own session and process group: signal all of it (ranks included).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record["pid"], sig)

    def _runs(self) -> list[tuple[str, dict]]:
        if not self.runs_dir.is_dir():
            return []
        runs = []
        for path in sorted(self.runs_dir.glob("L*.json")):
            record = self._record(path.stem)
            if record is not None:
                runs.append((path.stem, record))
        return runs

    def find(self, job_hash: str) -> str | None:
        for run_id, record in self._runs():
            if record.get("job_hash") == job_hash and self._alive(run_id, record):
                return run_id
        return None

    def queue_text(self, jobs: Collection[str] | None = None) -> str:
        wanted = None if jobs is None else set(jobs)
        lines = [f"{'JOBID':<20} {'NAME':<16} {'STATE':<10} PID"]
        for run_id, record in self._runs():
            if (wanted is None or record["job_hash"] in wanted) and self._alive(run_id, record):
                lines.append(f"{run_id:<20} {record['job_hash'][:16]:<16} {'RUNNING':<10} {record['pid']}")
        return "\n".join(lines) + "\n"

    def cluster_info(self) -> tuple[int, int]:
        return _local_gpus(), 1


def _local_gpus() -> int:
    """NVIDIA GPUs on this machine, counted without importing torch."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
