"""tests/support/early_release.py in a real pytest run of its own: a session fixture is stopped right
after the last test that needs it (directly or through another fixture), a client before the thing
it talks to, and a fixture that the last test needs is left to the session's own teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = '''
import pytest
from support.early_release import pytest_runtest_teardown, release_after_last_use


def log(event):
    with open("events.txt", "a") as out:
        out.write(event + "\\n")

@pytest.fixture(scope="session")
def server(request):
    log("server started")
    release_after_last_use(request, lambda: log("server stopped early"))
    yield
    log("server torn down")

@pytest.fixture(scope="session")
def client(server, request):
    release_after_last_use(request, lambda: log("client closed early"))
    yield

@pytest.fixture(scope="session")
def everywhere(request):
    release_after_last_use(request, lambda: log("everywhere stopped early"))
    yield
    log("everywhere torn down")
'''

TESTS_FILE = '''
from conftest import log

def test_1(server, everywhere):
    log("test_1")

def test_2(client, everywhere):
    log("test_2")

def test_3(everywhere):
    log("test_3")
'''


def test_a_session_fixture_stops_after_its_last_user(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_order.py").write_text(TESTS_FILE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_order.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "events.txt").read_text().splitlines() == [
        "server started",
        "test_1",
        "test_2",
        "client closed early",  # the client first: it still talks to the server as it closes
        "server stopped early",
        "test_3",
        "everywhere torn down",  # needed to the end: the session's own teardown, and only that
        "server torn down",
    ]
