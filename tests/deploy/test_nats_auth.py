"""NATS authentication in docker compose and the Helm chart: the server config both run is the one
nats_auth generates from nats_permissions, each service connects as its own user, and that config,
with the environment compose gives the server, starts a real nats-server that takes each password
and refuses a role outside its subjects."""

from __future__ import annotations

import asyncio
import base64
import subprocess
from urllib.parse import urlsplit

import nats
import pytest

from loopline.common.contracts import subjects
from loopline.common.local import launcher
from loopline.common.runtime import nats_auth, nats_permissions
from support.deploy import ROOT

SERVER_CONFIG = ROOT / "deploy" / "helm" / "loopline" / "files" / "nats-auth.conf"
COMPOSE_ROLES = {"gateway": "gateway", "queue": "queue", "inference": "inference", "trainer": "trainer",
                 "checkpoint-watcher": "checkpoint-watcher"}


def test_the_committed_server_config_is_the_generated_one():
    assert SERVER_CONFIG.read_text() == nats_auth.server_config(), (
        "regenerate: python -m loopline.common.runtime.nats_auth config > "
        "deploy/helm/loopline/files/nats-auth.conf")


def test_compose_runs_nats_with_auth_and_each_service_as_itself(compose_stacks, compose_nats_passwords):
    services = compose_stacks["compose"]["services"]
    nats_service = services["nats"]
    assert "-c" in nats_service["command"]
    assert any(v["source"].endswith("files/nats-auth.conf") for v in nats_service["volumes"])
    for variable, password in compose_nats_passwords.items():
        assert nats_service["environment"][variable] == password
    for service, role in COMPOSE_ROLES.items():
        url = urlsplit(services[service]["environment"]["LOOPLINE_NATS_URL"])
        password = compose_nats_passwords[nats_auth.password_variable(role)]
        assert (url.username, url.password) == (role, password)
    worker = urlsplit(services["trainer"]["environment"]["LOOPLINE_TINKER_WORKER_NATS_URL"])
    assert worker.username == nats_permissions.TINKER_WORKER


def _objects(chart: dict, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in chart["objects"] if o["kind"] == kind}


def test_helm_gives_each_service_its_own_user(charts):
    chart = charts["chart-defaults"]
    secret = _objects(chart, "Secret")["demo-loopline-nats"]["data"]
    assert set(secret) == set(nats_permissions.ROLES)
    conf = _objects(chart, "ConfigMap")["demo-loopline-nats"]["data"]["nats.conf"]
    assert nats_auth.server_config().split("authorization {", 1)[1].strip() in conf
    for deployment, role in (("demo-loopline-gateway", "gateway"), ("demo-loopline-queue", "queue"),
                             ("demo-loopline-inference", "inference"), ("demo-loopline-trainer", "trainer"),
                             ("demo-loopline-checkpoint-watcher", "checkpoint-watcher")):
        env = {e["name"]: e for e in _objects(chart, "Deployment")[deployment]["spec"]["template"]["spec"]
               ["containers"][0]["env"]}
        assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == role, deployment
        assert env["LOOPLINE_NATS_URL"]["value"].startswith(f"nats://{role}:$(NATS_PASSWORD)@"), deployment
    assert base64.b64decode(secret["gateway"]) != base64.b64decode(secret["queue"])


async def test_the_compose_server_config_takes_each_password_and_refuses_outside(compose_nats_passwords):
    port, monitor = launcher.free_port(), launcher.free_port()
    server = subprocess.Popen([launcher.nats_server_binary(), "-c", str(SERVER_CONFIG), "-a", "127.0.0.1",  # noqa: ASYNC220
                               "-p", str(port), "-m", str(monitor)],
                              env={"PATH": "/usr/bin:/bin", **compose_nats_passwords},
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        for attempt in range(50):
            try:
                replica = await nats.connect(
                    nats_auth.role_url(f"nats://127.0.0.1:{port}", "inference",
                                       compose_nats_passwords[nats_auth.password_variable("inference")]),
                    allow_reconnect=False, connect_timeout=1, error_cb=on_error)
                break
            except Exception:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.1)
        await replica.publish(subjects.job_event("h1", "completed"), b"{}")
        await replica.publish(subjects.result("g", 0), b"{}")
        await replica.flush()
        await asyncio.sleep(0.3)
        await replica.close()
        assert any("permissions violation" in e and "events.jobs.h1.completed" in e for e in errors), errors
        assert not any("results.g.0" in e for e in errors), errors
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await nats.connect(f"nats://gateway:wrong@127.0.0.1:{port}", allow_reconnect=False,
                               connect_timeout=1, max_reconnect_attempts=0)
    finally:
        server.terminate()
        server.wait(timeout=10)
