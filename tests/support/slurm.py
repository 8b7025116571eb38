"""A real single-node Slurm cluster (munged, slurmctld, slurmd) for the tests, private to one session.

Everything lives in a temporary directory: its own slurm.conf on free ports, its own munged socket,
state and spool directories. So two test sessions on one machine (or a developer's own Slurm) never
see each other's jobs, and stopping the cluster kills only the daemons started here. Client
commands (sbatch, squeue, ...) find the cluster through ``SLURM_CONF``, which the caller puts in the
environment of whatever should use it (the trainer service inherits it).

Needs the Slurm and munge packages (``scripts/slurm/install.sh``) and root (slurmd runs jobs as
their submitting user, and munged must run as the munge user).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loopline.common.local.launcher import free_port

MUNGED = "/usr/sbin/munged"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
MUNGE_KEY = Path("/etc/munge/munge.key")


def slurm_available() -> str | None:
    """None when a private cluster can be started here, else why not (for pytest.skip)."""
    if shutil.which("sbatch") is None:
        return "Slurm is not installed (scripts/slurm/install.sh)"
    for path in (MUNGED, SLURMCTLD, SLURMD, MUNGE_KEY):
        if not Path(path).exists():
            return f"{path} is missing (scripts/slurm/install.sh)"
    if os.geteuid() != 0:
        return "the Slurm daemons need root"
    return None


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)  # slurmctld, slurmd by name

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(argv, env={**os.environ, **self.env}, check=check, text=True,
                              capture_output=True, timeout=30)

    def node_state(self) -> str:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return out.stdout.strip()

    def cancel_all(self) -> None:
        self.run("scancel", "--user", pwd.getpwuid(os.geteuid()).pw_name, check=False)

    def kill_daemon(self, name: str) -> None:
        """``kill -9`` the daemon ``name`` (slurmctld or slurmd) alone: not its process group, so what
        it started (slurmd's slurmstepd, the jobs) lives on as it would after a daemon crash."""
        proc = self.daemons[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def start_daemon(self, name: str) -> None:
        """Start ``name`` again on its saved state (slurmctld recovers its jobs from
        StateSaveLocation, slurmd its running steps from its spool); returns once it answers."""
        assert self.daemons[name].poll() is not None, f"{name} is still running"
        proc = _spawn_daemon(self, name, recover=True)
        if name == "slurmctld":
            _wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, proc, name, 30,
                  self.log_tail)
        else:
            _wait(lambda: self.node_state().rstrip("*") in ("idle", "mixed", "allocated"), proc, name, 60,
                  self.log_tail)

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(parts)


def _write_conf(root: Path, munge_socket: Path) -> Path:
    cpus = os.cpu_count() or 1
    # Modest on purpose: the node must never be refused for memory it "lacks" (jobs ask for none).
    memory_mb = 2000
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=loopline-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# Finished jobs stay visible to squeue/scontrol this long (no slurmdbd here for sacct).
MinJobAge=600
# A cancelled job's processes get SIGTERM, then SIGKILL this many seconds later.
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
    return conf


def _start_munged(root: Path) -> tuple[subprocess.Popen, Path]:
    """Our own munged on its own socket, so no other munged (or user of it) is disturbed."""
    munge = pwd.getpwnam("munge")
    mdir = root / "munge"
    mdir.mkdir(mode=0o755)
    os.chown(mdir, munge.pw_uid, munge.pw_gid)
    socket = mdir / "munge.socket"
    argv = [
        "setpriv", f"--reuid={munge.pw_uid}", f"--regid={munge.pw_gid}", "--init-groups",
        MUNGED, "-F", f"--socket={socket}", f"--key-file={MUNGE_KEY}",
        f"--pid-file={mdir}/munged.pid", f"--seed-file={mdir}/munged.seed",
        f"--log-file={mdir}/munged.log",
    ]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    _wait(lambda: socket.exists(), proc, "munged", timeout_s=10)
    return proc, socket


def _spawn_daemon(cluster: SlurmCluster, name: str, *, recover: bool) -> subprocess.Popen:
    """Start slurmctld or slurmd in a session of its own, logging beside the others; it takes the
    place of the one before in ``cluster.procs`` (so the cluster's stop stops it)."""
    # -c: a clean start, no jobs from an earlier run (left out to recover after a crash);
    # -i: ignore state it cannot recover.
    argv = ([SLURMCTLD, "-D", "-i", *([] if recover else ["-c"])] if name == "slurmctld"
            else [SLURMD, "-D", "-N", "localhost"])
    with open(cluster.root / "log" / f"{name}.stdout", "ab") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **cluster.env}, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    old = cluster.daemons.get(name)
    cluster.procs[:] = [p for p in cluster.procs if p is not old] + [proc]
    cluster.daemons[name] = proc
    return proc


def _wait(ready, proc: subprocess.Popen, name: str, timeout_s: float, why=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}\n{why()}")
        if ready():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{name} not ready after {timeout_s}s\n{why()}")


def _stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the daemon's process group (it runs in its own session), SIGKILL what is left."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd; yield once the node is idle; stop them all after."""
    # Readable by the munge user (it must reach its socket directory inside).
    root = Path(tempfile.mkdtemp(prefix="loopline-slurm-"))
    root.chmod(0o755)
    for sub in ("state", "spool", "run", "log"):
        (root / sub).mkdir()
    cluster = SlurmCluster(root=root, conf=root / "slurm.conf")
    try:
        munged, socket = _start_munged(root)
        cluster.procs.append(munged)
        _write_conf(root, socket)
        for name in ("slurmctld", "slurmd"):
            proc = _spawn_daemon(cluster, name, recover=False)
            if name == "slurmctld":
                _wait(lambda: cluster.run("scontrol", "ping", check=False).returncode == 0,
                      proc, name, 30, cluster.log_tail)
        _wait(lambda: cluster.node_state() in ("idle", "mixed"), cluster.procs[-1], "slurmd", 60,
              cluster.log_tail)
        yield cluster
    finally:
        if len(cluster.procs) > 1:
            cluster.cancel_all()
        for proc in reversed(cluster.procs):
            _stop(proc)
        shutil.rmtree(root, ignore_errors=True)
