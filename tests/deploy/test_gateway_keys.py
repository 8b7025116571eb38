"""docker compose's gateway never comes up open: the compose file starts it through
deploy/docker/gateway_keys.py (``loopline-gateway-keys``), which makes and prints one key on the
first start, and runs it without keys only when LOOPLINE_OPEN_GATEWAY=1 says so. The script is run
here as the container runs it, with a real gateway on a real nats-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loopline.common.local import launcher
from support.deploy import COMPOSE_STACKS, DOCKERFILE, ROOT, compose_config, dockerfile_stages
from support.gateway_process import wait_until_up

# A real gateway started per case (~13 s in all): out of the edit loop.
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "deploy" / "docker" / "gateway_keys.py"
KEYS_MOUNT = "/var/lib/loopline/keys"
GATEWAY = [sys.executable, "-m", "loopline.gateway"]
# What the command the script runs saw: is the keys file set, and to what.
PRINT_ENV = [sys.executable, "-c",
             "import os; print('KEYS_FILE=' + os.environ.get('LOOPLINE_API_KEYS_FILE', '-'))"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    return {**env, **extra}


def _run(keys_file: Path, open_value: str, command: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "start", "--keys-file", str(keys_file),
                           "--open-gateway", open_value, "--", *command],
                          env=_env(**env), capture_output=True, text=True, timeout=60)


def _start(keys_file: Path, open_value: str, nats_url: str, state: Path) -> tuple[launcher.Proc, str]:
    """The script starting a real gateway, as compose's command does; the process and its URL."""
    port = launcher.free_port()
    log = state / "gateway.log"
    state.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        popen = subprocess.Popen(  # its own session: launcher.stop ends the gateway it execs
            [sys.executable, str(SCRIPT), "start", "--keys-file", str(keys_file), "--open-gateway",
             open_value, "--", *GATEWAY], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env=_env(LOOPLINE_NATS_URL=nats_url, LOOPLINE_STATE_DIR=str(state), LOOPLINE_PORT=str(port),
                     LOOPLINE_API_KEYS_FILE=f"{KEYS_MOUNT}/api-keys.json"))  # compose's, overridden
    proc, url = launcher.Proc("gateway", popen, log), f"http://127.0.0.1:{port}"
    wait_until_up(proc, url)
    return proc, url


def test_first_start_makes_one_key_prints_it_once_and_the_gateway_wants_it(nats_url, tmp_path):
    keys_file = tmp_path / "keys" / "api-keys.json"
    proc, url = _start(keys_file, "", nats_url, tmp_path / "gw")
    try:
        said = proc.log_tail(200)
        keys = [line.strip() for line in said.splitlines() if line.strip().startswith("tml-")]
        assert len(keys) == 1, said
        key = keys[0]
        stored = json.loads(keys_file.read_text())["keys"]
        assert [(k["name"], k["scopes"]) for k in stored] == [("admin", ["admin"])]
        assert key not in keys_file.read_text()  # its SHA-256 only
        assert keys_file.stat().st_mode & 0o077 == 0
        assert httpx.get(f"{url}/v1/health", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code == 200
        unkeyed = httpx.get(f"{url}/v1/health", timeout=10)
        assert unkeyed.status_code == 401 and "missing API key" in unkeyed.text, unkeyed.text
        assert httpx.post(f"{url}/v1/generate/clear_queue", timeout=10).status_code == 401
    finally:
        launcher.stop(proc)
    # A later start makes none and prints none; the key made first still stands.
    again = _run(keys_file, "0", PRINT_ENV)
    assert again.returncode == 0, again.stderr
    assert "tml-" not in again.stdout and "no key is made: the file exists" in again.stderr
    assert f"KEYS_FILE={keys_file}" in again.stdout
    assert json.loads(keys_file.read_text())["keys"] == stored


def test_open_gateway_only_when_asked_by_name(nats_url, tmp_path):
    keys_file = tmp_path / "keys" / "api-keys.json"
    proc, url = _start(keys_file, "1", nats_url, tmp_path / "gw")
    try:
        assert httpx.get(f"{url}/v1/health", timeout=10).status_code == 200  # no key needed
        assert "WITHOUT API keys" in proc.log_tail(200)
        assert not keys_file.exists()
    finally:
        launcher.stop(proc)
    # Anything but 1/true/yes or 0/false/no/empty is refused: a typo never opens the gateway.
    for value in ("on", "ture", "2"):
        refused = _run(keys_file, value, PRINT_ENV)
        assert refused.returncode == 2 and f"LOOPLINE_OPEN_GATEWAY={value!r}" in refused.stderr
        assert "KEYS_FILE" not in refused.stdout  # nothing ran
    both = _run(keys_file, "true", PRINT_ENV, LOOPLINE_API_KEYS="k1")
    assert both.returncode == 2 and "choose one" in both.stderr


def test_create_adds_a_key_once_per_name(tmp_path):
    keys_file = tmp_path / "api-keys.json"
    assert _run(keys_file, "", PRINT_ENV).returncode == 0  # the first key
    made = subprocess.run([sys.executable, str(SCRIPT), "create", "--name", "alice", "--scope", "inference"],
                          env=_env(LOOPLINE_API_KEYS_FILE=str(keys_file)), capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0 and made.stdout.startswith("tml-"), made.stderr
    assert [k["name"] for k in json.loads(keys_file.read_text())["keys"]] == ["admin", "alice"]
    twice = subprocess.run([sys.executable, str(SCRIPT), "create", "--keys-file", str(keys_file),
                            "--name", "alice", "--scope", "inference"], env=_env(), capture_output=True,
                           text=True, timeout=60)
    assert twice.returncode == 2 and "a key named 'alice' exists" in twice.stderr


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
def test_compose_gateway_starts_keyed_unless_opted_out(tools, monkeypatch, stack):
    gateway = compose_config(tools, COMPOSE_STACKS[stack])["services"]["gateway"]
    command = gateway["command"]
    assert command[:2] == ["loopline-gateway-keys", "start"] and command[-3:] == ["python", "-m",
                                                                                  "loopline.gateway"]
    assert command[command.index("--open-gateway") + 1] == ""  # keyed by default
    keys_file = gateway["environment"]["LOOPLINE_API_KEYS_FILE"]
    mount = {v["target"]: v for v in gateway["volumes"]}[KEYS_MOUNT]
    assert keys_file.startswith(KEYS_MOUNT + "/") and mount["type"] == "volume"  # kept across restarts
    monkeypatch.setenv("LOOPLINE_OPEN_GATEWAY", "1")
    opened = compose_config(tools, COMPOSE_STACKS[stack])["services"]["gateway"]["command"]
    assert opened[opened.index("--open-gateway") + 1] == "1"


def test_the_gateway_image_carries_the_script():
    gateway = dockerfile_stages(DOCKERFILE.read_text())["gateway"]
    # No --chmod (BuildKit's): the file is 0755 in git, and COPY keeps that.
    copy = "deploy/docker/gateway_keys.py /usr/local/bin/loopline-gateway-keys"
    assert copy in gateway.args("COPY")
    # The volume's folder: a new named volume takes its owner (the gateway's uid) and mode.
    folder = f"install -d -o loopline -g loopline -m 0700 {KEYS_MOUNT}"
    assert any(folder in run for run in gateway.args("RUN"))
