"""``python -m loopline.common.local.up`` (``make up``): the whole platform on this machine.

Starts a local nats-server with JetStream, the queue, trainer and checkpoint-watcher services, the
inference replicas and the gateway, each as its own process, waits until the gateway serves, prints
the URL, and on Ctrl-C (or SIGTERM) stops everything it started. Training jobs go to Slurm when its
controller answers, else to a local process per job; their directories are under
``<state dir>/jobs``, where the checkpoint-watcher picks up their checkpoints. ``LOOPLINE_MODEL`` may
name several models, each a deployment of its own (stack.py says how to set one deployment's flags).
On 127.0.0.1 a job's own ``ml/`` code is allowed unless ``LOOPLINE_ALLOW_USER_CODE`` says otherwise.
With API keys on (``LOOPLINE_API_KEYS`` or ``LOOPLINE_API_KEYS_FILE``) its readiness probes carry a key
(``stack.probe_key``): the user's first plain key, else one of its own that only the gateway gets.
An inference replica that exits (its engine died) is started again, with backoff, and the log says
so (restarts.py); any other process's exit stops the platform.

Ports: the gateway's (8000), NATS's client (4222) and monitoring (8222) ports are their defaults
while nothing listens there; a default that is taken (another ``make up``) moves to a free port, one
the user set stays as set. Every port is printed before the start. The processes' metrics ports are
free ones unless ``LOOPLINE_METRICS_PORT`` turns them off.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping

from loopline.common.config.settings import StackSettings
from loopline.common.local import launcher
from loopline.common.local.restarts import ReplicaRestarts
from loopline.common.local.stack import LocalStack

# `make up` on 127.0.0.1 is one user on their own machine: the ml/ code the scalarlm client ships
# from their folder is theirs to run (ScalarLM's "edit the loop locally"). Compose and Helm, which
# serve many users, leave it off.
LOCAL_DEFAULTS = {"LOOPLINE_ALLOW_USER_CODE": "true"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
PORT_NAMES = {"port": "gateway", "nats_port": "NATS", "nats_monitor_port": "NATS monitoring"}


def stack_defaults(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``make up`` gives its services where the user set none: only on loopback."""
    if host not in LOOPBACK:
        return {}
    return {name: value for name, value in LOCAL_DEFAULTS.items() if name not in environ}


def stack_ports(settings: StackSettings) -> tuple[dict[str, int], list[str]]:
    """The ports the stack binds, by StackSettings field (``port``, ``nats_port``,
    ``nats_monitor_port``), and what to print about them: a port the user set as set (taken, its
    server's start fails and says so), a default while free, else a free one."""
    hosts = {"port": settings.host, "nats_port": "127.0.0.1", "nats_monitor_port": "127.0.0.1"}
    ports, said = {}, []
    for field, host in hosts.items():
        wanted: int = getattr(settings, field)
        ports[field] = wanted
        if field not in settings.model_fields_set and not launcher.port_free(host, wanted):
            ports[field] = launcher.free_port(host)
        moved = f" ({wanted} is taken)" if ports[field] != wanted else ""
        said.append(f"{PORT_NAMES[field]} {host}:{ports[field]}{moved}")
    return ports, said


def refusal(settings: StackSettings) -> str | None:
    """Why the stack cannot run with these settings, or None."""
    if settings.metrics_port > 0:
        # One value for every process the stack starts: all but the first would fail to bind it.
        return (f"LOOPLINE_METRICS_PORT={settings.metrics_port} would give every process of the stack "
                "one port: leave it unset (each picks a free one, listed in /v1/health) or set -1 (off)")
    return None


def main() -> int:
    settings = StackSettings()
    if why := refusal(settings):
        print(f"loopline up: {why}", file=sys.stderr)
        return 2
    if "nats_url" in settings.model_fields_set:
        print(f"loopline up: LOOPLINE_NATS_URL={settings.nats_url} is not used: `make up` runs its own "
              "nats-server (LOOPLINE_NATS_PORT and LOOPLINE_NATS_MONITOR_PORT set its ports)",
              file=sys.stderr)
    ports, said = stack_ports(settings)
    try:
        stack = LocalStack(settings.state_dir, settings.model, host=settings.host, port=ports["port"],
                           nats_port=ports["nats_port"], nats_monitor_port=ports["nats_monitor_port"],
                           replicas=settings.inference_replicas, models_dir=settings.models_path,
                           jobs_dir=settings.jobs_path, env=stack_defaults(settings.host, os.environ))
    except ValueError as exc:  # the models and their per-deployment settings do not fit together
        print(f"loopline up: {exc}", file=sys.stderr)
        return 2

    def interrupt(*_args) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        served = ", ".join(f"{d.served_name} ({d.replicas} replica{'s' * (d.replicas != 1)})"
                           for d in stack.deployments)
        print(f"ports: {', '.join(said)}", flush=True)
        print(f"starting Loopline with {served} (first start prepares the model into "
              f"{stack.models_dir}; logs in {stack.logs}) …", flush=True)
        stack.start()
        print(f"\nLoopline is up: {stack.url}   dashboard: {stack.url}/ui   (Ctrl-C stops everything)\n",
              flush=True)
        # Invariant: every process we started is alive or, an inference replica, about to be
        # started again (restarts.py); if another dies, report it and stop the rest.
        restarts = ReplicaRestarts(stack)
        while not (dead := restarts.check()):
            time.sleep(0.5)
        for proc in dead:
            print(f"{proc.name} exited ({proc.popen.returncode}); its log ends:\n{proc.log_tail()}",
                  file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping …", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - tell the user what failed, then clean up
        print(f"loopline up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
