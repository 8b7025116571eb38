"""deploy/docker/healthcheck.py (the images' HEALTHCHECK and the chart's readiness probes) against a
real nats-server and real nats.micro services."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import nats
import pytest
from nats.micro import add_service

from loopline.common.contracts import subjects
from support.deploy import ROOT

SCRIPT = ROOT / "deploy" / "docker" / "healthcheck.py"


async def _check(url: str, *args: str, replica_id: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    env["LOOPLINE_NATS_URL"] = url
    if replica_id:
        env["LOOPLINE_REPLICA_ID"] = replica_id
    proc = await asyncio.create_subprocess_exec(sys.executable, str(SCRIPT), *args, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return subprocess.CompletedProcess(list(args), proc.returncode, out.decode(), err.decode())


# Tier: waits for the probe's time-outs, ~7 s.
@pytest.mark.slow
async def test_healthy_only_when_this_replica_answers(nats_url):
    nc = await nats.connect(nats_url)
    try:
        await add_service(nc, name=subjects.INFERENCE_SERVICE, version="0.1.0",
                          metadata={"replica": "inference-7"})
        # The chart names replicas after their pods (LOOPLINE_REPLICA_ID) ...
        assert (await _check(nats_url, "inference", replica_id="inference-7")).returncode == 0
        other = await _check(nats_url, "inference", replica_id="inference-8")
        assert other.returncode == 1 and "none of them this container's" in other.stderr
        # ... compose leaves the service's default, "<hostname>-<pid>".
        await add_service(nc, name=subjects.INFERENCE_SERVICE, version="0.1.0",
                          metadata={"replica": f"{socket.gethostname()}-4242"})
        assert (await _check(nats_url, "inference")).returncode == 0
        # A role nobody runs.
        none = await _check(nats_url, "trainer", replica_id="trainer-0")
        assert none.returncode == 1 and "no loopline-trainer instance answered" in none.stderr
        # Instances that publish no replica: any answer will do.
        await add_service(nc, name=subjects.QUEUE_SERVICE, version="0.1.0")
        assert (await _check(nats_url, "queue", replica_id="queue-0")).returncode == 0
    finally:
        await nc.close()


async def test_unhealthy_without_nats():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = await _check(f"nats://127.0.0.1:{port}", "queue")
    assert out.returncode == 1 and "NATS unreachable" in out.stderr


async def test_unknown_role_is_a_usage_error(nats_url):
    assert (await _check(nats_url, "gateway")).returncode == 2


# Tier: waits for the probe's time-outs, ~4 s.
@pytest.mark.slow
async def test_live_fails_only_when_nats_answers_and_this_replica_does_not(nats_url):
    """``--live``, the chart's liveness probe for inference replicas: a replica that no longer
    answers PING while NATS does (a hung replica) is restarted; with NATS down nothing can be told,
    and restarting every replica would not help."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    no_nats = await _check(f"nats://127.0.0.1:{port}", "--live", "inference", replica_id="inference-3")
    assert no_nats.returncode == 0 and "NATS unreachable" in no_nats.stderr
    hung = await _check(nats_url, "--live", "inference", replica_id="inference-3")
    assert hung.returncode == 1 and "no loopline-inference instance answered" in hung.stderr
    nc = await nats.connect(nats_url)
    try:
        await add_service(nc, name=subjects.INFERENCE_SERVICE, version="0.1.0",
                          metadata={"replica": "inference-3"})
        assert (await _check(nats_url, "--live", "inference", replica_id="inference-3")).returncode == 0
    finally:
        await nc.close()
