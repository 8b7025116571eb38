"""The platform on one machine: nats-server, queue, trainer, checkpoint-watcher, inference replicas and
gateway as processes.

``make up``, the end-to-end tests and the benchmarks all start Loopline through this class, so they
exercise the same start-up path users run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loopline.common import launcher


class LocalStack:
    def __init__(self, state_dir: Path, model: str, *, host: str = "127.0.0.1", port: int | None = None,
                 nats_port: int | None = None, nats_monitor_port: int | None = None, replicas: int = 1,
                 env: dict[str, str] | None = None, models_dir: Path | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.models_dir = Path(models_dir).resolve() if models_dir else self.state_dir / "models"
        self.model = model
        self.host = host
        self.port = port or launcher.free_port()
        self.nats_port = nats_port or launcher.free_port()
        self.nats_monitor_port = nats_monitor_port or launcher.free_port()
        self.replicas = replicas
        self.extra_env = env or {}
        self.nats: launcher.Proc | None = None
        self.queue: launcher.Proc | None = None
        self.trainer: launcher.Proc | None = None
        self.checkpoint_watcher: launcher.Proc | None = None
        self.gateway: launcher.Proc | None = None
        self.inference: dict[str, launcher.Proc] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    def env(self) -> dict[str, str]:
        return {
            "LOOPLINE_NATS_URL": self.nats_url,
            "LOOPLINE_STATE_DIR": str(self.state_dir),
            "LOOPLINE_MODEL": self.model,
            "LOOPLINE_MODELS_DIR": str(self.models_dir),
            "LOOPLINE_HOST": self.host,
            "LOOPLINE_PORT": str(self.port),
            # Training jobs: Slurm when a controller answers, else a local process per job.
            "LOOPLINE_JOBS_DIR": str(self.jobs_dir),
            **self.extra_env,
        }

    def prepare_model(self) -> str:
        """Resolve the model once up front, so replicas started together do not all convert it."""
        out = subprocess.run(
            [sys.executable, "-m", "loopline.ml.models", self.model,
             "--models-dir", str(self.models_dir)],
            check=True, stdout=subprocess.PIPE, text=True,
        )
        return out.stdout.strip().splitlines()[-1]

    def start(self, *, ready_timeout_s: float = 600) -> LocalStack:
        try:
            self.prepare_model()
            self.start_nats()
            self.queue = launcher.start_service("queue", self.env(), self.logs / "queue.log")
            self.trainer = launcher.start_service("trainer", self.env(), self.logs / "trainer.log")
            # Publishes the checkpoints the trainer's jobs write (same LOOPLINE_JOBS_DIR).
            self.checkpoint_watcher = launcher.start_service("checkpoint-watcher", self.env(),
                                                             self.logs / "checkpoint-watcher.log")
            for i in range(self.replicas):
                self.start_replica(f"r{i}")
            self.gateway = launcher.start_service("gateway", self.env(), self.logs / "gateway.log")
            launcher.wait_gateway_ready(self.gateway, self.url, timeout_s=ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_nats(self) -> launcher.Proc:
        self.nats = launcher.start_nats(self.state_dir / "nats", self.nats_port, self.nats_monitor_port,
                                        self.logs / "nats.log")
        return self.nats

    def restart_nats(self) -> None:
        assert self.nats is not None, "restart_nats() before start_nats()"
        launcher.stop(self.nats)
        self.start_nats()

    def start_replica(self, name: str) -> launcher.Proc:
        proc = launcher.start_service("inference", self.env(), self.logs / f"inference-{name}.log",
                                      replica=name)
        self.inference[name] = proc
        return proc

    def procs(self) -> list[launcher.Proc]:
        return [p for p in (self.nats, self.queue, self.trainer, self.checkpoint_watcher,
                            *self.inference.values(), self.gateway) if p is not None]

    def dead(self) -> list[launcher.Proc]:
        return [p for p in self.procs() if not p.alive()]

    def stop(self) -> None:
        """Stop the services first (they drain), NATS last."""
        for proc in (self.gateway, *self.inference.values(), self.checkpoint_watcher, self.trainer,
                     self.queue, self.nats):
            if proc is not None:
                launcher.stop(proc)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()
