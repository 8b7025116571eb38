"""The probe fixture: a service made of nothing but the shared runtime (support/runtime_probe.py),
started as its own process, for the runtime's tests (test_runtime.py, test_metrics.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopline.common.contracts.schemas import ServiceStatus
from loopline.common.runtime import bus
from support.runtime_probe import SERVICE, STATUS_SUBJECT

TESTS = Path(__file__).resolve().parents[1]


class Probe:
    def __init__(self, scenario: str, nats_url: str, log_path: Path, **env: str):
        self.log_path = log_path
        self.nats_url = nats_url
        base = {k: v for k, v in os.environ.items() if k != "LOOPLINE_REPLICA_ID"}
        path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "support.runtime_probe", scenario], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**base, "PYTHONPATH": path, "LOOPLINE_NATS_URL": nats_url, **env})

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log:
            assert self.popen.poll() is None, f"exited {self.popen.returncode} before {text!r}:\n{self.log}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{self.log}"
            time.sleep(0.05)

    def exit_code(self, timeout_s: float = 30) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            pytest.fail(f"still running after {timeout_s} s:\n{self.log}")

    def status(self) -> tuple[ServiceStatus, dict]:
        """Its answer on the status endpoint, and its nats.micro INFO."""
        async def ask() -> tuple[ServiceStatus, dict]:
            nc = await bus.connect(self.nats_url, "runtime-test")
            try:
                status = await nc.request(STATUS_SUBJECT, b"{}", timeout=5)
                info = await nc.request(f"$SRV.INFO.{SERVICE}", b"", timeout=5)
                return ServiceStatus.model_validate_json(status.data), json.loads(info.data)
            finally:
                await nc.close()

        return asyncio.run(ask())

    def signal(self, signum: int) -> float:
        self.popen.send_signal(signum)
        return time.monotonic()


@pytest.fixture
def probe(nats_url, tmp_path):
    started: list[Probe] = []

    def start(scenario: str, **env: str) -> Probe:
        started.append(Probe(scenario, nats_url, tmp_path / f"probe-{len(started)}.log", **env))
        return started[-1]

    yield start
    for p in started:
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait()
