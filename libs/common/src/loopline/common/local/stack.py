"""The platform on one machine: nats-server, queue, trainer, checkpoint-watcher, inference replicas and
gateway as processes.

``make up``, the end-to-end tests and the benchmarks all start Loopline through this class, so they
exercise the same start-up path users run.

Several deployments: ``LOOPLINE_MODEL`` may name several models, comma-separated (``tiny,tiny-embed``).
Each is a deployment of its own (its replicas, its WORK subject, its entry in ``/v1/models``); every
inference replica still serves exactly one model. A setting for one deployment only is the replica's
variable with ``__<MODEL KEY>`` appended, the key being the model's name in upper case with every run of
other characters one ``_`` (``model_key``): ``LOOPLINE_VLLM_ARGS__TINY_EMBED``,
``LOOPLINE_ADAPTERS__TINY_EMBED``, ``LOOPLINE_INFERENCE_REPLICAS__TINY_EMBED``. Without the suffix a
setting applies to every deployment. The gateway's default model and the trainer's are the first one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loopline.common.local import launcher
from loopline.common.runtime import nats_auth

# ``LOOPLINE_<SETTING>__<MODEL KEY>``: a model key never holds two underscores in a row, so the last
# ``__`` of a variable is where its model key starts.
KEY_SEPARATOR = "__"
REPLICAS_VARIABLE = "LOOPLINE_INFERENCE_REPLICAS"
SERVED_NAME_VARIABLE = "LOOPLINE_SERVED_MODEL_NAME"
# The gateway's API keys (GatewaySettings.api_keys / api_keys_file): either one set turns them on.
PLAIN_KEYS_VARIABLE = "LOOPLINE_API_KEYS"
KEYS_FILE_VARIABLE = "LOOPLINE_API_KEYS_FILE"


def probe_key(environ: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """The key the stack's own readiness probes send (``/v1/health`` wants one once keys are on), and
    what the gateway's environment gains for it. A plain key the user gave is used as it is (adding
    one would renumber theirs, ``LOOPLINE_API_KEYS#<n>``, and so their jobs' owner); with a keys file
    only (it holds hashes, no key), a fresh random key that lives in the gateway's environment and this
    process only, for as long as the stack runs. No keys: no key, nothing added."""
    plain = [key.strip() for key in environ.get(PLAIN_KEYS_VARIABLE, "").split(",") if key.strip()]
    if plain:
        return plain[0], {}
    if KEYS_FILE_VARIABLE in environ:  # set at all, even empty, GatewaySettings turns keys on
        key = "tml-probe-" + secrets.token_urlsafe(32)  # 256 bits; tml-: the Tinker SDK's prefix
        return key, {PLAIN_KEYS_VARIABLE: key}
    return None, {}


def model_key(model: str) -> str:
    """How per-deployment variables name ``model``: ``tiny-embed`` -> ``TINY_EMBED``,
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` -> ``HUGGINGFACETB_SMOLLM2_135M_INSTRUCT``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", model).strip("_").upper()


@dataclass(frozen=True)
class Deployment:
    """One model the stack serves: its replicas, and the settings only they get."""

    model: str  # one entry of LOOPLINE_MODEL: a name the replica resolves, or a folder
    key: str  # model_key(model)
    served_name: str  # the name clients use: LOOPLINE_SERVED_MODEL_NAME, else the model
    replicas: int
    env: dict[str, str]  # LOOPLINE_* variables (suffix removed) for this deployment's replicas


def plan_deployments(models: str, replicas: int, environ: Mapping[str, str]) -> list[Deployment]:
    """The deployments ``models`` (LOOPLINE_MODEL) names, each with ``replicas`` replicas unless its
    own variables in ``environ`` say otherwise. Refuses what would start a stack other than the one
    asked for: no model, two models with one key, a per-deployment variable for no model."""
    names = [name.strip() for name in models.split(",") if name.strip()]
    if not names:
        raise ValueError("LOOPLINE_MODEL names no model")
    by_key: dict[str, str] = {}
    # Invariant: by_key maps the key of every model seen so far to it, and no two share a key.
    for name in names:
        key = model_key(name)
        if key in by_key:
            raise ValueError(f"LOOPLINE_MODEL names {by_key[key]!r} and {name!r}, which share the key "
                             f"{key!r} of their per-deployment variables: give one a folder of another name")
        by_key[key] = name
    own: dict[str, dict[str, str]] = {key: {} for key in by_key}
    # Invariant: every suffixed Loopline variable seen so far names a model and sits in its ``own``.
    for variable, value in environ.items():
        setting, separator, key = variable.rpartition(KEY_SEPARATOR)
        if not separator or not setting.startswith("LOOPLINE_"):
            continue
        if key not in own:
            raise ValueError(f"{variable} is for the model key {key!r}, but LOOPLINE_MODEL has "
                             f"{', '.join(f'{n} ({k})' for k, n in by_key.items())}")
        if setting == "LOOPLINE_MODEL":
            raise ValueError(f"{variable}: a deployment's model is its entry in LOOPLINE_MODEL")
        own[key][setting] = value
    if len(names) > 1 and SERVED_NAME_VARIABLE in environ:
        raise ValueError(f"{SERVED_NAME_VARIABLE} would give {len(names)} models one name: set it per "
                         f"model ({SERVED_NAME_VARIABLE}__<MODEL KEY>)")
    deployments = []
    # Invariant: deployments holds the models before this one, in LOOPLINE_MODEL's order.
    for key, name in by_key.items():
        env = own[key]
        count = env.pop(REPLICAS_VARIABLE, None)
        if count is not None and not count.strip().isdigit():
            raise ValueError(f"{REPLICAS_VARIABLE}{KEY_SEPARATOR}{key}={count!r}: not a number of replicas")
        served_name = env.get(SERVED_NAME_VARIABLE) or environ.get(SERVED_NAME_VARIABLE) or name
        deployments.append(Deployment(name, key, served_name, replicas if count is None else int(count), env))
    served = [d.served_name for d in deployments]
    if len(set(served)) < len(served):
        raise ValueError(f"two deployments would be served under one name: {', '.join(served)}")
    return deployments


class LocalStack:
    def __init__(self, state_dir: Path, model: str, *, host: str = "127.0.0.1", port: int | None = None,
                 nats_port: int | None = None, nats_monitor_port: int | None = None, replicas: int = 1,
                 env: dict[str, str] | None = None, models_dir: Path | None = None,
                 jobs_dir: Path | None = None, nats_auth: bool = False):
        self.state_dir = Path(state_dir).resolve()
        self.models_dir = Path(models_dir).resolve() if models_dir else self.state_dir / "models"
        self.jobs_dir = Path(jobs_dir).resolve() if jobs_dir else self.state_dir / "jobs"
        self.model = model
        self.host = host
        self.port = port or launcher.free_port()
        self.nats_port = nats_port or launcher.free_port()
        self.nats_monitor_port = nats_monitor_port or launcher.free_port()
        self.replicas = replicas
        self.extra_env = env or {}
        # NATS with one user per role (nats_permissions.py), as compose and Helm run it; each
        # service's URL gets its own password (launcher.start_service). `make up` runs without.
        self.nats_auth = nats_auth
        # Per-deployment variables come from the stack's environment as much as from ``env``.
        self.deployments = plan_deployments(model, replicas, {**os.environ, **self.extra_env})
        # With API keys on, the probes (wait_gateway_ready, wait_deployments_served) carry this one.
        self.probe_key, self.probe_env = probe_key({**os.environ, **self.extra_env})
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
    def default_model(self) -> str:
        """What a request that names no model gets: the first deployment's served name."""
        return self.deployments[0].served_name

    def env(self) -> dict[str, str]:
        """What every service gets; the trainer's model is the first deployment's."""
        return {
            "LOOPLINE_NATS_URL": self.nats_url,
            "LOOPLINE_STATE_DIR": str(self.state_dir),
            "LOOPLINE_MODEL": self.deployments[0].model,
            "LOOPLINE_MODELS_DIR": str(self.models_dir),
            "LOOPLINE_HOST": self.host,
            "LOOPLINE_PORT": str(self.port),
            # Training jobs: Slurm when a controller answers, else a local process per job.
            "LOOPLINE_JOBS_DIR": str(self.jobs_dir),
            **({nats_auth.AUTH_DIR_VARIABLE: str(nats_auth.auth_dir(self.state_dir))}
               if self.nats_auth else {}),
            **self.extra_env,
        }

    def gateway_env(self) -> dict[str, str]:
        # The Tinker SDK's get_tokenizer() loads the model's folder: the clients are on this machine.
        return {**self.env(), "LOOPLINE_MODEL": self.default_model, "LOOPLINE_TINKER_TOKENIZER_ID": "folder",
                **self.probe_env}

    def replica_env(self, deployment: Deployment) -> dict[str, str]:
        return {**self.env(), "LOOPLINE_MODEL": deployment.model, **deployment.env}

    def prepare_model(self, model: str | None = None) -> str:
        """Resolve a model (the first deployment's by default) once up front, so replicas started
        together do not all convert it; its folder."""
        out = subprocess.run(
            [sys.executable, "-m", "loopline.ml.models", model or self.deployments[0].model,
             "--models-dir", str(self.models_dir)],
            check=True, stdout=subprocess.PIPE, text=True,
        )
        return out.stdout.strip().splitlines()[-1]

    def replica_names(self, deployment: Deployment) -> list[str]:
        """``r0``, ``r1``… with one deployment; ``<model key>-r0``… with several (``tiny-embed-r0``)."""
        prefix = f"{deployment.key.lower().replace('_', '-')}-" if len(self.deployments) > 1 else ""
        return [f"{prefix}r{i}" for i in range(deployment.replicas)]

    def start(self, *, ready_timeout_s: float = 600) -> LocalStack:
        try:
            for deployment in self.deployments:
                self.prepare_model(deployment.model)
            self.start_nats()
            self.queue = launcher.start_service("queue", self.env(), self.logs / "queue.log")
            self.trainer = launcher.start_service("trainer", self.env(), self.logs / "trainer.log")
            # Publishes the checkpoints the trainer's jobs write (same LOOPLINE_JOBS_DIR).
            self.checkpoint_watcher = launcher.start_service("checkpoint-watcher", self.env(),
                                                             self.logs / "checkpoint-watcher.log")
            for deployment in self.deployments:
                for name in self.replica_names(deployment):
                    self.start_replica(name, deployment)
            self.gateway = launcher.start_service("gateway", self.gateway_env(), self.logs / "gateway.log")
            deadline = time.monotonic() + ready_timeout_s
            launcher.wait_gateway_ready(self.gateway, self.url, timeout_s=ready_timeout_s,
                                        api_key=self.probe_key)
            self.wait_deployments_served(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_deployments_served(self, deadline: float) -> None:
        """Wait until a replica of every deployment answers (the gateway is ready at the first):
        /v1/health lists each replica that answered with the model it serves."""
        expected = {d.served_name for d in self.deployments}
        served: set[str] = set()
        # Invariant: every process is alive and some deployment has had no replica answer yet.
        while True:
            if dead := self.dead():
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].popen.returncode}:\n"
                                   f"{dead[0].log_tail()}")
            try:
                request = urllib.request.Request(f"{self.url}/v1/health",
                                                 headers=launcher.bearer(self.probe_key))
                with urllib.request.urlopen(request, timeout=2) as resp:
                    replicas = json.loads(resp.read()).get("services", {}).get("vllm", [])
                served = {r.get("model") for r in replicas}
                if expected <= served:
                    return
            except OSError:
                pass  # the gateway is busy; ask again
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica of {', '.join(sorted(expected - served))} answered")
            time.sleep(0.2)

    def start_nats(self) -> launcher.Proc:
        config = nats_auth.write_local_config(self.state_dir)[0] if self.nats_auth else None
        self.nats = launcher.start_nats(self.state_dir / "nats", self.nats_port, self.nats_monitor_port,
                                        self.logs / "nats.log", config)
        return self.nats

    def restart_nats(self) -> None:
        assert self.nats is not None, "restart_nats() before start_nats()"
        launcher.stop(self.nats)
        self.start_nats()

    def start_replica(self, name: str, deployment: Deployment | None = None) -> launcher.Proc:
        """Start one replica of ``deployment`` (the first by default) named ``name``."""
        env = self.replica_env(deployment or self.deployments[0])
        proc = launcher.start_service("inference", env, self.logs / f"inference-{name}.log", replica=name)
        self.inference[name] = proc
        return proc

    def restart_service(self, service: str, *, kill: bool = True) -> launcher.Proc:
        """``kill -9`` one of ``queue``, ``trainer``, ``checkpoint-watcher``, ``gateway`` (with
        ``kill=False``: only if it died) and start it again, same environment, same log, same port.
        For the fault tests and the soak; a restarted gateway is waited for until it is ready."""
        attribute = service.replace("-", "_")
        old: launcher.Proc | None = getattr(self, attribute, None)
        if service not in launcher.SERVICE_MODULES or service == "inference" or old is None:
            raise ValueError(f"no running {service!r} to restart")
        if kill:
            launcher.kill(old)
        env = self.gateway_env() if service == "gateway" else self.env()
        proc = launcher.start_service(service, env, old.log_path)
        setattr(self, attribute, proc)
        if service == "gateway":
            launcher.wait_gateway_ready(proc, self.url, api_key=self.probe_key)
        return proc

    def restart_replica(self, name: str, *, kill: bool = True) -> launcher.Proc:
        """``kill -9`` replica ``name`` (with ``kill=False``: only if it died) and start it again for
        the same deployment."""
        deployment = next(d for d in self.deployments if name in self.replica_names(d))
        if kill:
            launcher.kill(self.inference[name])
        return self.start_replica(name, deployment)

    def procs(self) -> list[launcher.Proc]:
        return [p for p in (self.nats, self.queue, self.trainer, self.checkpoint_watcher,
                            *self.inference.values(), self.gateway) if p is not None]

    def dead(self) -> list[launcher.Proc]:
        return [p for p in self.procs() if not p.alive()]

    def stop(self) -> None:
        """Stop the services first (they drain), then what the local launcher still runs for the
        trainer (Tinker session workers, unfinished jobs: each in a session of its own), NATS last."""
        for proc in (self.gateway, *self.inference.values(), self.checkpoint_watcher, self.trainer,
                     self.queue):
            if proc is not None:
                launcher.stop(proc)
        launcher.stop_local_runs(self.jobs_dir / ".local-runs")
        if self.nats is not None:
            launcher.stop(self.nats)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()
