"""Per-key limits and key rotation on a real gateway process: over its rate or its queue share a key
gets 429 with ``Retry-After`` (OpenAI's error shape on the OpenAI routes, ``{"detail"}`` on the
Tinker API's); ``loopline keys`` adds, rotates and revokes keys while the gateway runs, and the
gateway follows within a second or two, without a restart. Without keys, a gateway that listens
beyond this machine says so when it starts."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from loopline.cli.main import app as cli_app
from loopline.common.local import launcher
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from support.gateway_process import start_gateway

KEYS = {name: new_key() for name in ("paced", "paced-tinker", "narrow")}
RETRY_AFTER_S = 3  # LOOPLINE_RETRY_AFTER_S: the Retry-After of a full queue share
# Two requests at once, then one a minute: the third in a row is refused for about a minute.
PACED = {"requests_per_minute": 1, "burst": 2}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    write_key_file(path, KeyFile(keys=[
        KeyEntry(name="paced", sha256=key_hash(KEYS["paced"]), scopes=["inference"], **PACED),
        KeyEntry(name="paced-tinker", sha256=key_hash(KEYS["paced-tinker"]), scopes=["training"], **PACED),
        KeyEntry(name="narrow", sha256=key_hash(KEYS["narrow"]), scopes=["training"], max_in_flight=1)]))
    return path


@pytest.fixture(scope="module")
def limited(nats_proc, keys_file, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("limited"),
                       LOOPLINE_API_KEYS_FILE=str(keys_file), LOOPLINE_RETRY_AFTER_S=str(RETRY_AFTER_S))
    yield gw
    launcher.stop(gw.proc)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_over_its_rate_a_key_gets_429_in_openais_shape(limited):
    answers = [httpx.get(f"{limited.url}/v1/models", headers=bearer(KEYS["paced"])) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    refused = answers[2]
    # One request a minute: the next token is a minute (less the few ms since the burst) away.
    assert 50 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and "1 requests per minute" in error["message"]


def test_over_its_rate_a_tinker_client_gets_429_in_tinkers_shape(limited):
    url = f"{limited.url}/api/v1/training_runs"
    answers = [httpx.get(url, headers={"X-API-Key": KEYS["paced-tinker"]}) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert int(answers[2].headers["retry-after"]) >= 50
    assert "'paced-tinker'" in answers[2].json()["detail"]


def test_over_its_queue_share_a_key_gets_429(limited):
    """max_in_flight=1: while a request of the key is in progress (here a job-event stream, held
    open), the next is refused; once it ends, the key is let through again."""
    opened, close = threading.Event(), threading.Event()
    # Answered from NATS alone (this gateway has no trainer), with the key as the tinker SDK sends it.
    probe = f"{limited.url}/api/v1/training_runs"
    narrow = {"X-API-Key": KEYS["narrow"]}

    def hold_a_stream():
        with httpx.stream("GET", f"{limited.url}/v1/megatron/events", headers=bearer(KEYS["narrow"]),
                          timeout=30) as stream:
            assert stream.status_code == 200
            opened.set()
            close.wait(30)

    holder = threading.Thread(target=hold_a_stream)
    holder.start()
    try:
        assert opened.wait(10)
        refused = httpx.get(probe, headers=narrow)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "in progress" in refused.json()["detail"]
    finally:
        close.set()
        holder.join(10)
    # The gateway learns of the client's going on its own time (the disconnect, or its next write).
    deadline = time.monotonic() + 30
    # Invariant: every answer so far was the 429 of a share still held.
    while (status := httpx.get(probe, headers=narrow).status_code) == 429:
        assert time.monotonic() < deadline, "the stream's slot was never given back"
        time.sleep(0.2)
    assert status == 200


def wait_for_status(url: str, key: str, want: int, timeout_s: float = 5.0) -> float:
    """Poll until ``key`` gets ``want``; how long that took."""
    started = time.monotonic()
    # Invariant: every answer so far was not yet the wanted one.
    while (status := httpx.get(url, headers=bearer(key)).status_code) != want:
        assert time.monotonic() - started < timeout_s, f"still {status}, not {want}, after {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - started


def test_keys_are_added_rotated_and_revoked_while_the_gateway_runs(limited, keys_file):
    cli = CliRunner()
    url = f"{limited.url}/v1/models"
    pid = limited.proc.pid

    made = cli.invoke(cli_app, ["keys", "create", "--name", "late", "--scope", "inference",
                                "--file", str(keys_file)])
    assert made.exit_code == 0, made.output
    key = made.stdout.strip()
    assert key.startswith("tml-") and key not in keys_file.read_text()
    assert wait_for_status(url, key, 200) < 3  # looked at once a second, at most

    rotated = cli.invoke(cli_app, ["keys", "rotate", "late", "--file", str(keys_file)])
    assert rotated.exit_code == 0, rotated.output
    new = rotated.stdout.strip()
    wait_for_status(url, new, 200)
    assert httpx.get(url, headers=bearer(key)).status_code == 401

    revoked = cli.invoke(cli_app, ["keys", "revoke", "late", "--file", str(keys_file)])
    assert revoked.exit_code == 0, revoked.output
    wait_for_status(url, new, 401)
    assert limited.proc.pid == pid and limited.proc.alive()  # the same process throughout


def test_a_keys_file_that_is_not_one_keeps_the_keys_read_before(nats_proc, tmp_path):
    path = tmp_path / "api_keys.json"
    key = new_key()
    write_key_file(path, KeyFile(keys=[KeyEntry(name="kept", sha256=key_hash(key), scopes=["inference"])]))
    gw = start_gateway(nats_proc.info["url"], tmp_path / "gw", LOOPLINE_API_KEYS_FILE=str(path))
    try:
        path.write_text('{"keys": [{"name": "x"}]}')  # a bad edit
        time.sleep(1.5)
        assert httpx.get(f"{gw.url}/v1/models", headers=bearer(key)).status_code == 200
        assert "keeping the 1 keys read before" in gw.proc.log_tail()
    finally:
        launcher.stop(gw.proc)


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_listening_beyond_this_machine_without_keys_is_warned_of(nats_proc, tmp_path, host, warned):
    gw = start_gateway(nats_proc.info["url"], tmp_path, LOOPLINE_HOST=host)
    try:
        assert ("with no API keys" in gw.proc.log_tail()) == warned
    finally:
        launcher.stop(gw.proc)
