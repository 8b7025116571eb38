"""The Helm chart rendered offline (Helm's own Go SDK) for its default values, the GPU/multi-replica
values file and the other supported shapes; every manifest validated against the Kubernetes API
schema of a pinned version (deploy/helm/check_chart.py KUBERNETES_VERSION)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess

import nats
import pytest

from loopline.common.local import launcher
from loopline.common.runtime import bus
from support.deploy import (
    CHART_VALUES,
    CHECK_CHART,
    DOCKERFILE,
    dockerfile_stages,
    load_check_chart,
    render_chart,
)

CASES = load_check_chart()


def _objects(chart: dict, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in chart["objects"] if o["kind"] == kind}


def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", sorted(CHART_VALUES))
def test_every_manifest_is_valid_kubernetes(charts, name):
    chart = charts[name]
    assert chart["objects"], "nothing rendered"
    assert chart["errors"] == [], json.dumps(chart["errors"], indent=1)


@pytest.mark.parametrize("case", sorted(set(CASES.GOOD) - {"defaults"}))
def test_other_supported_values_render_valid_manifests(tools, case):
    chart = render_chart(tools, set_json=CASES.GOOD[case])
    assert chart["errors"] == [], json.dumps(chart["errors"], indent=1)


@pytest.mark.parametrize("case", sorted(CASES.BAD))
def test_bad_values_are_refused(tools, case):
    out = tools.run(tools.python, str(CHECK_CHART), "render", "--set-json", json.dumps(CASES.BAD[case]))
    assert out.returncode == 3, f"the chart accepted {case}: {out.stdout[:300]}"


def test_the_validator_rejects_a_broken_manifest(tools, charts):
    """Proves the schema check can fail: a real rendered Deployment with a wrong type and a typo."""
    gateway = _objects(charts["chart-defaults"], "Deployment")["demo-loopline-gateway"]
    deployment = json.loads(json.dumps(gateway))
    deployment["spec"]["replicas"] = "three"
    _pod_spec(deployment)["containers"][0]["livenesProbe"] = {}
    out = tools.run(tools.python, str(CHECK_CHART), "validate", stdin=json.dumps([deployment]))
    assert out.returncode == 0, out.stderr
    errors = json.loads(out.stdout)
    assert len(errors) == 1 and errors[0]["object"] == "Deployment/demo-loopline-gateway"


def test_helm_lint_strict(tools):
    for files in CHART_VALUES.values():
        argv = [tools.python, str(CHECK_CHART), "lint"] + [a for f in files for a in ("-f", str(f))]
        out = tools.run(*argv)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [], out.stdout


def test_default_chart_has_every_service(charts):
    chart = charts["chart-defaults"]
    deployments = _objects(chart, "Deployment")
    statefulsets = _objects(chart, "StatefulSet")
    for component in ("gateway", "queue", "inference", "trainer", "checkpoint-watcher"):
        assert f"demo-loopline-{component}" in deployments, component
    for component in ("nats", "postgres", "slurm-controller", "slurm-compute"):
        assert f"demo-loopline-{component}" in statefulsets, component
    jobs = _objects(chart, "PersistentVolumeClaim")["demo-loopline-jobs"]
    assert jobs["spec"]["accessModes"] == ["ReadWriteMany"]
    nats = statefulsets["demo-loopline-nats"]
    assert "jetstream" in _objects(chart, "ConfigMap")["demo-loopline-nats"]["data"]["nats.conf"]
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def _by_container(chart: dict) -> dict[str, tuple[dict, dict]]:
    """container name -> (container, pod spec), over every workload of the rendering."""
    out = {}
    for obj in chart["objects"]:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            for container in _pod_spec(obj)["containers"]:
                out[container["name"]] = (container, _pod_spec(obj))
    return out


@pytest.mark.parametrize("name", sorted(CHART_VALUES))
def test_jobs_volume_shared_at_one_path(charts, name):
    claims = set()
    for component in ("trainer", "slurmd", "checkpoint-watcher"):
        container, pod = _by_container(charts[name])[component]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "jobs")
        assert mount["mountPath"] == "/var/lib/loopline/jobs", component
        volume = next(v for v in pod["volumes"] if v["name"] == "jobs")
        claims.add(volume["persistentVolumeClaim"]["claimName"])
    assert len(claims) == 1, claims


@pytest.mark.parametrize("name", sorted(CHART_VALUES))
def test_secrets_come_from_secrets(charts, name):
    """Passwords and keys reach the containers through secretKeyRef, never as literal values."""
    for component, (container, _) in _by_container(charts[name]).items():
        env = {e["name"]: e for e in container.get("env", [])}
        for var in ("NATS_PASSWORD", "POSTGRES_PASSWORD", "LOOPLINE_API_KEYS"):
            if var in env:
                assert "secretKeyRef" in env[var].get("valueFrom", {}), (component, var)
        url = env.get("LOOPLINE_NATS_URL", {})
        if "@" in url.get("value", ""):
            assert "$(NATS_PASSWORD)" in url["value"], component
    for component in ("slurmctld", "slurmd", "trainer"):
        container, pod = _by_container(charts[name])[component]
        volume = next(v for v in pod["volumes"] if v["name"] == "munge-key")
        assert "secret" in volume, component


def test_gpu_values_ask_for_gpus_and_replicas(charts):
    chart = charts["chart-gpu"]
    deployments = _objects(chart, "Deployment")
    inference = deployments["demo-loopline-inference"]
    assert inference["spec"]["replicas"] == 4
    container = _pod_spec(inference)["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith("/loopline/inference-gpu:0.1.0")
    assert deployments["demo-loopline-gateway"]["spec"]["replicas"] == 3
    compute = _objects(chart, "StatefulSet")["demo-loopline-slurm-compute"]
    assert compute["spec"]["replicas"] == 2
    slurmd = _pod_spec(compute)["containers"][0]
    assert slurmd["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert slurmd["image"].endswith("/loopline/slurm-compute-gpu:0.1.0")
    assert slurmd["args"] == ["slurmd", "--conf", "CPUs=64 RealMemory=480000"]
    trainer = _pod_spec(deployments["demo-loopline-trainer"])["containers"][0]
    assert trainer["image"].endswith("/loopline/trainer-gpu:0.1.0")
    assert "demo-loopline-postgres" not in _objects(chart, "StatefulSet")


@pytest.mark.parametrize("name", sorted(CHART_VALUES))
def test_inference_replicas_are_restarted_when_they_exit_or_hang(charts, name):
    """A replica whose vLLM engine died exits 1: its pod's container restarts (restartPolicy
    Always, the default). One that hangs fails the liveness probe (``--live``: only when NATS
    answers and it does not), which waits for the startup probe's first success (loading)."""
    replicas = [d for n, d in _objects(charts[name], "Deployment").items() if "inference" in n]
    assert replicas
    for deployment in replicas:
        pod = _pod_spec(deployment)
        assert pod.get("restartPolicy", "Always") == "Always"
        container = next(c for c in pod["containers"] if c["name"] == "inference")
        live, startup = container["livenessProbe"], container["startupProbe"]
        assert live["exec"]["command"] == ["loopline-healthcheck", "--live", "inference"]
        assert startup["exec"]["command"] == ["loopline-healthcheck", "inference"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # an hour to load


@pytest.mark.parametrize(("name", "expected"), [
    ("chart-defaults", "port-forward service/demo-loopline-gateway"),
    ("chart-gpu", "LOOPLINE_URL=https://loopline.example.com"),
])
def test_notes_say_how_to_reach_the_gateway(charts, name, expected):
    assert expected in charts[name]["notes"]


def test_images_are_dockerfile_targets(charts):
    stages = dockerfile_stages(DOCKERFILE.read_text())
    for chart in charts.values():
        for container, _pod in _by_container(chart).values():
            repository = container["image"].rsplit(":", 1)[0]
            if "/loopline/" in f"/{repository}":
                target = repository.rsplit("/", 1)[1]
                assert target in stages, f"{container['image']}: no such Dockerfile target"


async def test_chart_nats_config_with_auth_runs(charts, tmp_path):
    """The chart's nats.conf, in a real nats-server with the environment the StatefulSet gives it:
    a service's URL (its own password from the chart's Secret) gets in and creates the topology,
    a wrong password does not."""
    chart = charts["chart-defaults"]
    conf = _objects(chart, "ConfigMap")["demo-loopline-nats"]["data"]["nats.conf"]
    secret = _objects(chart, "Secret")["demo-loopline-nats"]["data"]
    user = "queue"
    password = base64.b64decode(secret[user]).decode()
    port, monitor = launcher.free_port(), launcher.free_port()
    # The pod's paths and ports, moved to this test's.
    conf = (conf.replace("port: 4222", f"port: {port}").replace("http_port: 8222", f"http_port: {monitor}")
            .replace("store_dir: /data", f"store_dir: {tmp_path / 'data'}"))
    assert f"port: {port}" in conf and str(tmp_path) in conf
    (tmp_path / "nats.conf").write_text(conf)
    container = _pod_spec(_objects(chart, "StatefulSet")["demo-loopline-nats"])["containers"][0]
    env = {"PATH": "/usr/bin:/bin", "SERVER_NAME": "demo-loopline-nats-0"}
    for variable in container["env"]:  # each role's password, from the Secret's key for it
        if "valueFrom" in variable and "secretKeyRef" in variable["valueFrom"]:
            key = variable["valueFrom"]["secretKeyRef"]["key"]
            env[variable["name"]] = base64.b64decode(secret[key]).decode()
    # Popen only starts the server; nothing here waits on it outside the event loop.
    server = subprocess.Popen([launcher.nats_server_binary(), "--config", str(tmp_path / "nats.conf")],  # noqa: ASYNC220
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async def connect(secret: str):
            return await nats.connect(f"nats://{user}:{secret}@127.0.0.1:{port}", allow_reconnect=False,
                                      max_reconnect_attempts=1, reconnect_time_wait=0.1, connect_timeout=2)

        for _ in range(50):
            try:
                nc = await connect(password)
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert server.poll() is None, server.stderr.read().decode()
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the chart's nats.conf did not start a server that takes its password")
        await bus.ensure_topology(nc.jetstream())  # JetStream is on, and the queue may create it
        await nc.close()
        # Refused for the password, not for anything else (a dead server, a time-out).
        with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
            await (await connect("n" + "x" * 31)).close()
    finally:
        server.terminate()
        server.wait(timeout=10)
