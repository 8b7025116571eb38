"""``python -m loopline.common.up`` (``make up``): the whole platform on this machine.

Starts a local nats-server with JetStream, the queue service, the inference replicas and the gateway,
each as its own process, waits until the gateway serves, prints the URL, and on Ctrl-C (or SIGTERM)
stops everything it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from loopline.common import launcher
from loopline.common.settings import StackSettings


def prepare_model(settings: StackSettings) -> None:
    """Resolve the model once up front, so replicas started together do not all convert it."""
    print(f"preparing model {settings.model} …", flush=True)
    subprocess.run(
        [sys.executable, "-m", "loopline.ml.models", settings.model, "--models-dir", str(settings.models_dir)],
        check=True, stdout=subprocess.DEVNULL,
    )


def main() -> int:
    settings = StackSettings()
    state = settings.state_dir.resolve()
    logs = state / "logs"
    procs: list[launcher.Proc] = []

    def shutdown(*_args) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, shutdown)
    try:
        prepare_model(settings)
        nats = launcher.start_nats(state / "nats", settings.nats_port, settings.nats_monitor_port,
                                   logs / "nats.log")
        procs.append(nats)
        env = {
            "LOOPLINE_NATS_URL": nats.info["url"],
            "LOOPLINE_STATE_DIR": str(state),
            "LOOPLINE_MODEL": settings.model,
            "LOOPLINE_HOST": settings.host,
            "LOOPLINE_PORT": str(settings.port),
        }
        procs.append(launcher.start_service("queue", env, logs / "queue.log"))
        for i in range(settings.inference_replicas):
            procs.append(launcher.start_service("inference", env, logs / f"inference-{i}.log", replica=f"r{i}"))
        gateway = launcher.start_service("gateway", env, logs / "gateway.log")
        procs.append(gateway)
        url = f"http://{settings.host}:{settings.port}"
        print(f"starting services (logs in {logs}) …", flush=True)
        launcher.wait_gateway_ready(gateway, url, timeout_s=600)
        print(f"\nLoopline is up: {url}   (model {settings.model}; Ctrl-C stops everything)\n", flush=True)
        # Invariant: every process we started is alive; if one dies, report it and stop the rest.
        while True:
            for proc in procs:
                if not proc.alive():
                    print(f"{proc.name} exited ({proc.popen.returncode}); its log:\n{proc.log_tail()}",
                          file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping …", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - tell the user, then clean up
        print(f"loopline up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in reversed(procs):
            launcher.stop(proc)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
