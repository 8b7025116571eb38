"""``make up``'s entry point starts every service as its own process, and Ctrl-C stops them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loopline.common.local.launcher import free_port
from loopline.common.local.up import stack_defaults
from support.stacks import MODELS_DIR, tiny_model


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
