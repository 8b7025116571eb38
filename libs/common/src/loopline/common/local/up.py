"""``python -m loopline.common.local.up`` (``make up``): the whole platform on this machine.

Starts a local nats-server with JetStream, the queue, trainer and checkpoint-watcher services, the
inference replicas and the gateway, each as its own process, waits until the gateway serves, prints
the URL, and on Ctrl-C (or SIGTERM) stops everything it started. Training jobs go to Slurm when its
controller answers, else to a local process per job; their directories are under
``<state dir>/jobs``, where the checkpoint-watcher picks up their checkpoints. ``LOOPLINE_MODEL`` may
name several models, each a deployment of its own (stack.py says how to set one deployment's flags).
On 127.0.0.1 a job's own ``ml/`` code is allowed unless ``LOOPLINE_ALLOW_USER_CODE`` says otherwise.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping

from loopline.common.config.settings import StackSettings
from loopline.common.local.stack import LocalStack

# `make up` on 127.0.0.1 is one user on their own machine: the ml/ code the scalarlm client ships
# from their folder is theirs to run (ScalarLM's "edit the loop locally"). Compose and Helm, which
# serve many users, leave it off.
LOCAL_DEFAULTS = {"LOOPLINE_ALLOW_USER_CODE": "true"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def stack_defaults(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``make up`` gives its services where the user set none: only on loopback."""
    if host not in LOOPBACK:
        return {}
    return {name: value for name, value in LOCAL_DEFAULTS.items() if name not in environ}


def main() -> int:
    settings = StackSettings()
    try:
        stack = LocalStack(settings.state_dir, settings.model, host=settings.host, port=settings.port,
                           nats_port=settings.nats_port, nats_monitor_port=settings.nats_monitor_port,
                           replicas=settings.inference_replicas,
                           env=stack_defaults(settings.host, os.environ))
    except ValueError as exc:  # the models and their per-deployment settings do not fit together
        print(f"loopline up: {exc}", file=sys.stderr)
        return 2

    def interrupt(*_args) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        served = ", ".join(f"{d.served_name} ({d.replicas} replica{'s' * (d.replicas != 1)})"
                           for d in stack.deployments)
        print(f"starting Loopline with {served} (first start prepares the model; logs in "
              f"{stack.logs}) …", flush=True)
        stack.start()
        print(f"\nLoopline is up: {stack.url}   (Ctrl-C stops everything)\n", flush=True)
        # Invariant: every process we started is alive; if one dies, report it and stop the rest.
        while not (dead := stack.dead()):
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
