"""``loopline keys`` on a keys file: a key is printed once and only its hash is kept; list shows
names, scopes and limits, never keys; rotate and revoke act by name; mistakes are exit 2 with a
message. That the gateway follows the file while it runs is tests/gateway/test_api_keys_limits.py."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from typer.testing import CliRunner

from loopline.cli.main import app as cli_app
from loopline.gateway.auth.key_store import key_hash, read_key_file

LOOPLINE = str(Path(sys.executable).with_name("loopline"))  # the installed command


def keys(*args: str):
    return CliRunner().invoke(cli_app, ["keys", *args])


def test_create_prints_the_key_once_and_stores_its_hash(tmp_path):
    path = tmp_path / "api_keys.json"
    made = keys("create", "--name", "alice", "--scope", "inference", "--scope", "training", "--rpm", "120",
                "--burst", "5", "--max-in-flight", "4", "--file", str(path))
    assert made.exit_code == 0, made.output
    key = made.stdout.strip()
    assert key.startswith("tml-") and len(key) > 40
    assert "only time it is shown" in made.stderr
    text = path.read_text()
    assert key not in text
    entry = json.loads(text)["keys"][0]
    assert entry["sha256"] == key_hash(key) and entry["scopes"] == ["inference", "training"]
    assert (entry["requests_per_minute"], entry["burst"], entry["max_in_flight"]) == (120, 5, 4)
    assert path.stat().st_mode & 0o077 == 0

    listed = keys("list", "--file", str(path))
    assert listed.exit_code == 0
    assert "alice" in listed.stdout and "inference,training" in listed.stdout and key not in listed.stdout


def test_rotate_keeps_the_name_and_scopes_and_revoke_removes(tmp_path):
    path = tmp_path / "api_keys.json"
    first = keys("create", "--name", "ci", "-s", "training", "--file", str(path)).stdout.strip()
    rotated = keys("rotate", "ci", "--file", str(path))
    assert rotated.exit_code == 0, rotated.output
    second = rotated.stdout.strip()
    (entry,) = read_key_file(path).keys
    assert second != first and entry.sha256 == key_hash(second) and entry.scopes == ["training"]
    assert keys("revoke", "ci", "--file", str(path)).exit_code == 0
    assert read_key_file(path).keys == []
    assert "no keys" in keys("list", "--file", str(path)).stderr


def test_mistakes_are_exit_2_with_a_message(tmp_path):
    path = tmp_path / "api_keys.json"
    assert keys("create", "--name", "dup", "-s", "admin", "--file", str(path)).exit_code == 0
    again = keys("create", "--name", "dup", "-s", "admin", "--file", str(path))
    assert again.exit_code == 2 and "exists" in again.stderr
    assert len(read_key_file(path).keys) == 1  # nothing written by the refused one
    bad = keys("create", "--name", "no spaces", "-s", "admin", "--file", str(path))
    assert bad.exit_code == 2 and "--name" in bad.stderr
    assert keys("create", "--name", "x", "-s", "root", "--file", str(path)).exit_code == 2
    missing = keys("revoke", "nobody", "--file", str(path))
    assert missing.exit_code == 2 and "no key named 'nobody'" in missing.stderr
    path.write_text("{not json")
    broken = keys("list", "--file", str(path))
    assert broken.exit_code == 2 and str(path) in broken.stderr


def test_commands_at_once_lose_no_key(tmp_path):
    """Each its own process, as two operators' would be: the lock file orders their writes."""
    path = tmp_path / "api_keys.json"

    def create(n: int) -> int:
        return subprocess.run([LOOPLINE, "keys", "create", "--name", f"k{n}", "-s", "inference",
                               "--file", str(path)], capture_output=True, timeout=60).returncode

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(create, range(4))) == [0] * 4
    assert sorted(e.name for e in read_key_file(path).keys) == ["k0", "k1", "k2", "k3"]
