"""``make up``'s entry point starts every service as its own process, and Ctrl-C stops them all; its
default ports move when taken, and it honours the documented settings (LOOPLINE_MODELS_DIR...)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loopline.common.config.settings import StackSettings
from loopline.common.local.launcher import free_port
from loopline.common.local.up import refusal, stack_defaults
from support.stacks import MODELS_DIR, tiny_model

# Tier: each test runs make up's whole stack.
pytestmark = pytest.mark.stack

# StackSettings' defaults: what another `make up` (or a NATS of one's own) already listens on.
DEFAULT_PORTS = {name: StackSettings.model_fields[name].default
                 for name in ("port", "nats_port", "nats_monitor_port")}


def processes_with_state_dir(state_dir: Path) -> set[int]:
    found = set()
    marker = f"LOOPLINE_STATE_DIR={state_dir}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (marker in (entry / "environ").read_bytes().split(b"\0")
                    and (entry / "stat").read_text().split()[2] != "Z"):  # zombies are gone already
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def test_up_starts_everything_and_ctrl_c_leaves_nothing_behind(tmp_path):
    state = tmp_path / "state"
    port = free_port()
    env = {**os.environ, "LOOPLINE_MODEL": tiny_model(), "LOOPLINE_STATE_DIR": str(state),
           "LOOPLINE_MODELS_DIR": str(MODELS_DIR), "LOOPLINE_PORT": str(port),
           "LOOPLINE_NATS_PORT": str(free_port()), "LOOPLINE_NATS_MONITOR_PORT": str(free_port())}
    up = subprocess.Popen([sys.executable, "-m", "loopline.common.local.up"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while not any("Loopline is up" in line for line in lines):
            assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
            lines.append(up.stdout.readline())
        assert f"http://127.0.0.1:{port}" in lines[-1]
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [env["LOOPLINE_MODEL"]]
        # nats-server, queue, inference and gateway, each its own process.
        assert len(processes_with_state_dir(state.resolve()) - {up.pid}) >= 4
        # One user on 127.0.0.1: the ml/ code they ship runs (compose and Helm keep it off).
        trainer = [pid for pid in processes_with_state_dir(state.resolve())
                   if b"loopline.trainer" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        environ = Path(f"/proc/{trainer[0]}/environ").read_bytes().split(b"\0")
        assert b"LOOPLINE_ALLOW_USER_CODE=true" in environ
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:  # a failed assertion: stop the stack as Ctrl-C does, or it outlives us
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
    deadline = time.monotonic() + 10
    while processes_with_state_dir(state.resolve()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with_state_dir(state.resolve())


def test_up_allows_user_code_only_on_loopback_and_unless_set():
    assert stack_defaults("127.0.0.1", {}) == {"LOOPLINE_ALLOW_USER_CODE": "true"}
    assert stack_defaults("127.0.0.1", {"LOOPLINE_ALLOW_USER_CODE": "false"}) == {}
    assert stack_defaults("0.0.0.0", {}) == {}  # others can reach it: off unless asked for


@contextlib.contextmanager
def listening_on(ports: list[int]) -> Iterator[None]:
    """Something listening on each of ``ports`` at 127.0.0.1 (a port already listened on by
    someone else is as taken)."""
    held = []
    try:
        for port in ports:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not fooled by TIME_WAIT
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
            except OSError:
                sock.close()
                continue
            held.append(sock)
        yield
    finally:
        for sock in held:
            sock.close()


def stop_up(up: subprocess.Popen) -> None:
    """Stop the stack as Ctrl-C does."""
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


@pytest.fixture(scope="module")
def up_beside_taken_ports(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """``make up`` started while its default ports are taken, no port set, the tiny model named
    (not a folder) with LOOPLINE_MODELS_DIR holding it, LOOPLINE_JOBS_DIR beside the state dir: the
    process, its ``ports:`` line, its state dir. Stopped at the end; the tests need no more than
    its start (NATS up, the replica loading)."""
    state = tmp_path_factory.mktemp("up") / "state"
    jobs = state.parent / "jobs"
    tiny_model()  # prepared under MODELS_DIR, as a shared models folder is
    environ = {k: v for k, v in os.environ.items()
               if k not in ("LOOPLINE_PORT", "LOOPLINE_NATS_PORT", "LOOPLINE_NATS_MONITOR_PORT")}
    env = {**environ, "LOOPLINE_MODEL": "tiny", "LOOPLINE_STATE_DIR": str(state),
           "LOOPLINE_MODELS_DIR": str(MODELS_DIR), "LOOPLINE_JOBS_DIR": str(jobs)}
    with listening_on(list(DEFAULT_PORTS.values())):
        up = subprocess.Popen([sys.executable, "-m", "loopline.common.local.up"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            lines: list[str] = []
            deadline = time.monotonic() + 120
            while not lines or not lines[-1].startswith("ports:"):
                assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
                lines.append(up.stdout.readline())
            yield up, lines[-1], state.resolve()
        finally:
            stop_up(up)
    deadline = time.monotonic() + 10
    while processes_with_state_dir(state.resolve()) and time.monotonic() < deadline:
        time.sleep(0.2)


def test_taken_default_ports_move_to_free_ones_and_are_printed(up_beside_taken_ports):
    up, said, _state = up_beside_taken_ports
    ports = {name: int(re.search(rf"{label} 127\.0\.0\.1:(\d+)", said).group(1)) for name, label in
             (("port", "gateway"), ("nats_port", "NATS"), ("nats_monitor_port", "NATS monitoring"))}
    for name, default in DEFAULT_PORTS.items():
        assert ports[name] != default and f"({default} is taken)" in said, said
    # The stack's nats-server serves on the ports printed: monitoring, then a client's INFO.
    deadline = time.monotonic() + 120
    while True:
        assert up.poll() is None and time.monotonic() < deadline, "NATS never answered"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{ports['nats_monitor_port']}/healthz", timeout=2).is_success:
                break
        time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", ports["nats_port"]), timeout=5) as client:
        assert client.recv(4096).startswith(b"INFO ")


def test_the_models_dir_set_is_used_and_nothing_is_prepared_again(up_beside_taken_ports):
    up, _said, state = up_beside_taken_ports
    replica_log = state / "logs" / "inference-r0.log"
    deadline = time.monotonic() + 180
    while not (loading := re.search(r"loading tiny from (\S+)", _text(replica_log))):
        assert up.poll() is None and time.monotonic() < deadline, _text(replica_log)
        time.sleep(0.2)
    assert Path(loading.group(1)) == Path(tiny_model()).resolve()
    assert not (state / "models").exists(), "the model was prepared again under the state dir"


def test_the_jobs_dir_set_is_the_trainers_and_the_watchers(up_beside_taken_ports):
    up, _said, state = up_beside_taken_ports
    wanted = f"LOOPLINE_JOBS_DIR={state.parent / 'jobs'}".encode()
    deadline = time.monotonic() + 120
    # Invariant: up is alive and not both services have been seen yet.
    while True:
        assert up.poll() is None and time.monotonic() < deadline, "trainer or watcher never started"
        found = {}
        for pid in processes_with_state_dir(state):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                for module in (b"loopline.trainer", b"loopline.checkpoint_watcher"):
                    if module in cmdline:
                        found[module] = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if len(found) == 2:
            break
        time.sleep(0.2)
    for module, environ in found.items():
        assert wanted in environ, module
    assert not (state / "jobs").exists()


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def test_up_refuses_one_metrics_port_for_all_its_processes(tmp_path):
    assert refusal(StackSettings(metrics_port=0)) is None
    assert refusal(StackSettings(metrics_port=-1)) is None
    env = {**os.environ, "LOOPLINE_STATE_DIR": str(tmp_path), "LOOPLINE_METRICS_PORT": "9400"}
    out = subprocess.run([sys.executable, "-m", "loopline.common.local.up"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "LOOPLINE_METRICS_PORT=9400 would give every process of the stack one port" in out.stderr
    assert not (tmp_path / "logs").exists()
