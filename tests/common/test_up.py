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
from loopline.common.local.stack import probe_key
from loopline.common.local.up import refusal, stack_defaults
from loopline.gateway.auth import key_store
from support.stacks import MODELS_DIR, tiny_model

# Tier: each test runs make up's whole stack.
pytestmark = pytest.mark.stack

# StackSettings' defaults: what another `make up` (or a NATS of one's own) already listens on.
DEFAULT_PORTS = {name: StackSettings.model_fields[name].default
                 for name in ("port", "nats_port", "nats_monitor_port")}
# The one key in the keys file `up_beside_taken_ports` starts the stack with.
KEY = key_store.new_key()


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
    # SIGINT as a terminal delivers it: a test run started in the background (`cmd &` without job
    # control, as CI scripts do) inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt, so up would not hear the Ctrl-C this test sends.
    up = subprocess.Popen([sys.executable, "-m", "loopline.common.local.up"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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
                up.wait()
        # Whatever up left (killed, it cannot stop its children): a stack leaked here held ~2.5 GB
        # for the rest of a CI run and the OOM killer then took other tests' engines.
        leaked = processes_with_state_dir(state.resolve()) if state.exists() else set()
        for pid in leaked if up.returncode != 0 else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while processes_with_state_dir(state.resolve()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with_state_dir(state.resolve())


def test_up_allows_user_code_only_on_loopback_and_unless_set():
    assert stack_defaults("127.0.0.1", {}) == {"LOOPLINE_ALLOW_USER_CODE": "true"}
    assert stack_defaults("127.0.0.1", {"LOOPLINE_ALLOW_USER_CODE": "false"}) == {}
    assert stack_defaults("0.0.0.0", {}) == {}  # others can reach it: off unless asked for


def test_the_probes_key_is_the_users_first_plain_one_else_one_only_the_gateway_gets():
    assert probe_key({}) == (None, {})
    # The user's plain keys as they are: one more would renumber them (LOOPLINE_API_KEYS#<n>).
    assert probe_key({"LOOPLINE_API_KEYS": " k1 ,k2", "LOOPLINE_API_KEYS_FILE": "f"}) == ("k1", {})
    # A keys file holds hashes: a fresh key, each stack its own, added beside the file's.
    key, env = probe_key({"LOOPLINE_API_KEYS_FILE": "/keys.json"})
    assert env == {"LOOPLINE_API_KEYS": key} and len(key) > 40
    assert probe_key({"LOOPLINE_API_KEYS_FILE": "/keys.json"})[0] != key


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
    (not a folder) with LOOPLINE_MODELS_DIR holding it, LOOPLINE_JOBS_DIR beside the state dir, API
    keys on (LOOPLINE_API_KEYS_FILE, holding ``KEY``): the process, its ``ports:`` line, its state
    dir. Stopped at the end; most tests need no more than its start (NATS up, the replica loading),
    one waits until it is up."""
    state = tmp_path_factory.mktemp("up") / "state"
    jobs = state.parent / "jobs"
    keys_file = state.parent / "api-keys.json"
    key_store.write_key_file(keys_file, key_store.KeyFile(keys=[key_store.KeyEntry(
        name="alice", sha256=key_store.key_hash(KEY), scopes=["inference"])]))
    tiny_model()  # prepared under MODELS_DIR, as a shared models folder is
    environ = {k: v for k, v in os.environ.items()
               if k not in ("LOOPLINE_PORT", "LOOPLINE_NATS_PORT", "LOOPLINE_NATS_MONITOR_PORT",
                            "LOOPLINE_API_KEYS")}
    env = {**environ, "LOOPLINE_MODEL": "tiny", "LOOPLINE_STATE_DIR": str(state),
           "LOOPLINE_MODELS_DIR": str(MODELS_DIR), "LOOPLINE_JOBS_DIR": str(jobs),
           "LOOPLINE_API_KEYS_FILE": str(keys_file)}
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


def test_up_with_a_keys_file_starts_and_wants_a_key(up_beside_taken_ports):
    """With API keys on, make up's own probes still see the stack come up (they asked /v1/health
    without a key, got 401 and waited 600 s); then the file's key is served and no key is 401."""
    up, _said, _state = up_beside_taken_ports
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while not lines or "Loopline is up" not in lines[-1]:
        assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
        lines.append(up.stdout.readline())
    url = re.search(r"Loopline is up: (\S+)", lines[-1]).group(1)
    keyed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert keyed.status_code == 200 and [m["id"] for m in keyed.json()["data"]] == ["tiny"], keyed.text
    for path in ("/v1/models", "/v1/health"):
        unkeyed = httpx.get(f"{url}{path}", timeout=10)
        assert unkeyed.status_code == 401 and "missing API key" in unkeyed.text, (path, unkeyed.text)
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer tml-not-a-key"}, timeout=10)
    assert wrong.status_code == 401 and "invalid API key" in wrong.text, wrong.text
    assert httpx.get(f"{url}/v1/health/keepalive", timeout=10).status_code == 200  # the open probe


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
