#!/usr/bin/env python3
"""Health check for the Loopline services that answer over NATS only (no HTTP port).

    loopline-healthcheck [--live] queue|inference|trainer|checkpoint-watcher

Installed in the images as /usr/local/bin/loopline-healthcheck; used by their Docker HEALTHCHECK
and by the Helm chart's readiness probes. Healthy means: NATS answers, and this container's own
replica answers a nats.micro PING for its service (the same PING the gateway's /v1/health sends).
A replica is recognised by the ``replica`` entry of its service metadata: LOOPLINE_REPLICA_ID when
set (the chart sets the pod name), else the service's default "<hostname>-<pid>". A service whose
instances publish no ``replica`` counts as healthy when any instance answers.

As it is, it is a readiness signal, not a liveness one: when NATS is down every replica fails it,
and restarting them would not help (they reconnect by themselves). With ``--live`` (the chart's
liveness probe for inference replicas) it fails only when NATS answers and this replica does not: a
replica whose event loop hangs. One whose vLLM engine died exits by itself (its engine watch).

Licence: CC0-1.0.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

import nats

from loopline.common.contracts import subjects

SERVICES = {
    "queue": subjects.QUEUE_SERVICE,
    "inference": subjects.INFERENCE_SERVICE,
    "trainer": subjects.TRAINER_SERVICE,
    "checkpoint-watcher": subjects.CHECKPOINT_WATCHER_SERVICE,
}
NATS_UNREACHABLE = "NATS unreachable"
# Replies to one PING arrive within milliseconds; a busy replica may take longer.
COLLECT_S = 3.0


def is_mine(metadata: dict) -> bool:
    replica = metadata.get("replica")
    wanted = os.environ.get("LOOPLINE_REPLICA_ID")
    if wanted:
        return replica == wanted
    return isinstance(replica, str) and replica.startswith(socket.gethostname() + "-")


async def check(service: str) -> str | None:
    """None when healthy, else why not."""
    url = os.environ.get("LOOPLINE_NATS_URL", "nats://127.0.0.1:4222")

    async def quiet(_exc: Exception) -> None:
        pass  # the answer below says it once; nats-py would print a traceback per attempt

    try:
        # Two tries, then give up (max_reconnect_attempts=0 would mean "retry forever").
        nc = await asyncio.wait_for(
            nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=1,
                         reconnect_time_wait=0.2, error_cb=quiet),
            timeout=6)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the answer
        return f"{NATS_UNREACHABLE}: {type(exc).__name__}: {exc}"
    try:
        replies: list[dict] = []
        enough = asyncio.Event()
        inbox = nc.new_inbox()

        async def collect(msg) -> None:
            try:
                reply = json.loads(msg.data)
            except ValueError:
                return
            replies.append(reply)
            metadata = reply.get("metadata") or {}
            # Replicas of one service are alike: one without a replica id means none has one.
            if "replica" not in metadata or is_mine(metadata):
                enough.set()

        await nc.subscribe(inbox, cb=collect)
        await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
        await nc.flush()
        try:
            await asyncio.wait_for(enough.wait(), COLLECT_S)
        except TimeoutError:
            pass
    finally:
        await nc.close()
    if enough.is_set():
        return None
    if not replies:
        return f"no {service} instance answered"
    return f"{len(replies)} {service} instance(s) answered, none of them this container's"


def main() -> int:
    args = sys.argv[1:]
    live = args[:1] == ["--live"]
    args = args[1:] if live else args
    if len(args) != 1 or args[0] not in SERVICES:
        print(f"usage: loopline-healthcheck [--live] {'|'.join(SERVICES)}", file=sys.stderr)
        return 2
    why = asyncio.run(check(SERVICES[args[0]]))
    if why and live and why.startswith(NATS_UNREACHABLE):
        print(f"alive as far as can be told: {why}", file=sys.stderr)
        return 0
    if why:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
