"""The chart with what a production user sets (deploy/helm/loopline/ci/production-values.yaml): API
keys, NATS and PostgreSQL URLs all from the operator's own Secrets, two model deployments, GPUs for
inference and the Slurm nodes, nothing of NATS or PostgreSQL installed. Rendered by Helm's Go SDK;
the manifests' schema validation and ``helm lint --strict`` run for it in test_helm.py, as for the
other values files. Not installed on a cluster: there is none here."""

from __future__ import annotations

import json

import pytest

NATS_SECRET = {"name": "loopline-nats", "key": "url"}
DB_SECRET = {"name": "loopline-db", "key": "url"}


@pytest.fixture(scope="module")
def chart(charts) -> dict:
    return charts["chart-production"]


def workloads(chart: dict) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in chart["objects"] if o["kind"] in ("Deployment", "StatefulSet")}


def containers(chart: dict) -> dict[str, dict]:
    """workload name -> its first container."""
    return {name: w["spec"]["template"]["spec"]["containers"][0] for name, w in workloads(chart).items()}


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_it_renders_valid_manifests(chart):
    assert chart["errors"] == []


def test_nothing_of_nats_or_postgres_is_installed(chart):
    names = [f"{o['kind']}/{o['metadata']['name']}" for o in chart["objects"]]
    assert not [n for n in names if "nats" in n or "postgres" in n], names


def test_every_service_reads_its_urls_from_the_operators_secrets(chart):
    services = containers(chart)
    needs_nats = {"gateway", "queue", "inference", "inference-embed", "trainer", "checkpoint-watcher"}
    for short in needs_nats:
        variables = env(services[f"demo-loopline-{short}"])
        assert variables["LOOPLINE_NATS_URL"]["valueFrom"]["secretKeyRef"] == NATS_SECRET, short
    for short in ("queue", "trainer"):
        variables = env(services[f"demo-loopline-{short}"])
        assert variables["LOOPLINE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == DB_SECRET, short
    gateway = env(services["demo-loopline-gateway"])
    assert gateway["LOOPLINE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "loopline-api-keys"


def test_no_credential_is_written_into_a_manifest(chart):
    # The chart makes no Secret of its own for keys or URLs (only Slurm's munge key), and no
    # value anywhere holds a URL with credentials.
    secrets = [o["metadata"]["name"] for o in chart["objects"] if o["kind"] == "Secret"]
    assert secrets == ["demo-loopline-munge"]
    text = json.dumps(chart["objects"])
    assert "://" not in text.replace("http://", "").replace("https://", ""), "a nats:// or postgresql:// URL"


def test_two_deployments_on_gpus_with_their_own_models_and_replicas(chart):
    found = workloads(chart)
    generation, embed = found["demo-loopline-inference"], found["demo-loopline-inference-embed"]
    assert (generation["spec"]["replicas"], embed["spec"]["replicas"]) == (3, 1)
    for workload, model, adapters in ((generation, "HuggingFaceTB/SmolLM2-135M-Instruct", "true"),
                                      (embed, "BAAI/bge-small-en-v1.5", "false")):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "registry.example.com/ml/loopline/inference-gpu:1.0.0"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        variables = env(container)
        assert variables["LOOPLINE_MODEL"]["value"] == model
        assert variables["LOOPLINE_ADAPTERS"]["value"] == adapters
        assert variables["LOOPLINE_MAX_MODEL_LEN"]["value"] == "4096"
        spec = workload["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_training_runs_on_two_gpu_slurm_nodes(chart):
    found = workloads(chart)
    compute = found["demo-loopline-slurm-compute"]
    assert compute["spec"]["replicas"] == 2
    slurmd = compute["spec"]["template"]["spec"]["containers"][0]
    assert slurmd["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert slurmd["image"] == "registry.example.com/ml/loopline/slurm-compute-gpu:1.0.0"
    assert slurmd["args"] == ["slurmd", "--conf", "CPUs=32 RealMemory=240000"]
    trainer = containers(chart)["demo-loopline-trainer"]
    assert trainer["image"] == "registry.example.com/ml/loopline/trainer-gpu:1.0.0"


def test_the_gateway_and_queue_are_replicated(chart):
    found = workloads(chart)
    assert found["demo-loopline-gateway"]["spec"]["replicas"] == 2
    assert found["demo-loopline-queue"]["spec"]["replicas"] == 2
