"""The environment the deployments give each service is the one its settings class reads.

For every container of the compose stacks (with and without the GPU override) and of the chart
(default values and ci/gpu-values.yaml): each LOOPLINE_* variable it sets, or its image sets, must
be a field (or alias) of that service's class in loopline.common.config.settings; the settings a service
cannot run without in a multi-container deployment must be set; the literal values must pass the
class's own validation; and Kubernetes $(VAR) references must point at a variable defined before.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pytest

from loopline.common.config import settings as settings_module
from support.deploy import (
    CHART_VALUES,
    COMPOSE_STACKS,
    DOCKERFILE,
    dockerfile_stages,
    image_env,
    settings_env_names,
)

# service -> (settings class, variables it must be given). Defaults that are wrong in a container:
# NATS on 127.0.0.1, SQLite in the container's own filesystem, a gateway listening on loopback,
# job directories that the compute nodes cannot see.
SERVICES = {
    "gateway": ("GatewaySettings", {"LOOPLINE_NATS_URL", "LOOPLINE_STATE_DIR", "LOOPLINE_HOST",
                                    "LOOPLINE_MODEL"}),
    "queue": ("QueueSettings", {"LOOPLINE_NATS_URL", "LOOPLINE_STATE_DIR", "LOOPLINE_DATABASE_URL"}),
    "inference": ("InferenceSettings", {"LOOPLINE_NATS_URL", "LOOPLINE_STATE_DIR", "LOOPLINE_MODEL"}),
    "trainer": ("TrainerSettings", {"LOOPLINE_NATS_URL", "LOOPLINE_STATE_DIR", "LOOPLINE_DATABASE_URL",
                                    "LOOPLINE_JOBS_DIR", "LOOPLINE_LAUNCHER", "LOOPLINE_MODEL",
                                    "LOOPLINE_MODELS_DIR"}),
    "checkpoint-watcher": ("CheckpointWatcherSettings", {"LOOPLINE_NATS_URL", "LOOPLINE_STATE_DIR",
                                                         "LOOPLINE_JOBS_DIR"}),
}
# Containers that run no Loopline service: a LOOPLINE_* variable there would be read by nothing.
OTHERS = {"nats", "postgres", "slurmctld", "slurmd", "slurm-compute", "munge-key"}
# Set by the deployments ahead of the service that will read them (see docs/deployment.md); each
# has its own test below, which fails once the service reads it and this entry can go. None now.
PENDING: dict[str, set[str]] = {}
SOURCES = sorted(COMPOSE_STACKS) + sorted(CHART_VALUES)
# What a Secret, a field reference or an unset compose variable stands for when values are checked.
OPAQUE = "opaque-value"


@dataclass
class Container:
    name: str
    target: str | None                       # the Dockerfile target of its image
    env: list[tuple[str, str | None]]        # in order; None: from a Secret, a field, the host
    mounts: set[str] = field(default_factory=set)

    def own(self) -> dict[str, str | None]:
        return dict(self.env)


STAGES = dockerfile_stages(DOCKERFILE.read_text())


def _target_of_image(image: str) -> str | None:
    name = image.rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return name if name in STAGES else None


def _compose_containers(config: dict) -> list[Container]:
    out = []
    for name, service in config["services"].items():
        target = (service.get("build") or {}).get("target") or _target_of_image(service["image"])
        env = list((service.get("environment") or {}).items())
        mounts = {v["target"] for v in service.get("volumes", [])}
        out.append(Container(name, target, env, mounts))
    return out


def _chart_containers(chart: dict) -> list[Container]:
    out = []
    for obj in chart["objects"]:
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            env = [(e["name"], e.get("value") if "valueFrom" not in e else None)
                   for e in container.get("env", [])]
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            out.append(Container(container["name"], _target_of_image(container["image"]), env, mounts))
    return out


@pytest.fixture(scope="session")
def containers(compose_stacks, charts) -> dict[str, list[Container]]:
    found = {name: _compose_containers(config) for name, config in compose_stacks.items()}
    found.update({name: _chart_containers(chart) for name, chart in charts.items()})
    return found


def _effective(container: Container) -> dict[str, str | None]:
    """What the process sees: the image's ENV, overridden by the container's."""
    env: dict[str, str | None] = dict(image_env(STAGES, container.target)) if container.target else {}
    env.update(container.own())
    return env


def _settings_class(service: str):
    name = SERVICES[service][0]
    cls = getattr(settings_module, name, None)
    assert cls is not None, f"loopline.common.config.settings has no {name}, the {service} service's settings"
    return cls


@pytest.mark.parametrize("source", SOURCES)
def test_every_container_is_known(containers, source):
    unknown = {c.name for c in containers[source]} - set(SERVICES) - OTHERS
    assert not unknown, f"containers {unknown}: map them to a settings class (or OTHERS) in this test"


@pytest.mark.parametrize("source", SOURCES)
def test_other_containers_set_no_loopline_variables(containers, source):
    for container in containers[source]:
        if container.name in OTHERS:
            stray = [k for k, _ in container.env if k.startswith("LOOPLINE_")]
            assert not stray, f"{container.name} sets {stray}, which nothing there reads"


@pytest.mark.parametrize("service", sorted(SERVICES))
@pytest.mark.parametrize("source", SOURCES)
def test_service_environment_matches_its_settings(containers, monkeypatch, source, service):
    mine = [c for c in containers[source] if c.name == service]
    assert mine, f"{source} has no {service} container"
    cls = _settings_class(service)
    names = settings_env_names(cls)
    required = SERVICES[service][1]
    assert required <= set(names), f"{cls.__name__} no longer reads {sorted(required - set(names))}"
    for container in mine:
        env = _effective(container)
        loopline = {k: v for k, v in env.items() if k.startswith("LOOPLINE_")}
        unknown = set(loopline) - set(names) - PENDING.get(service, set())
        assert not unknown, f"{source}/{service} sets {sorted(unknown)}, which {cls.__name__} does not read"
        missing = required - set(loopline)
        assert not missing, f"{source}/{service} does not set {sorted(missing)}"
        # The literal values must pass the class's own validation (types, patterns).
        for key in [k for k in os.environ if k.upper().startswith("LOOPLINE_")]:
            monkeypatch.delenv(key)
        for key, value in loopline.items():
            if key in names:
                monkeypatch.setenv(key, OPAQUE if value is None else re.sub(r"\$\(\w+\)", "x", value))
        cls()


@pytest.mark.parametrize("source", sorted(CHART_VALUES))
def test_kubernetes_variable_references_are_defined_before(containers, source):
    for container in containers[source]:
        defined: set[str] = set()
        for key, value in container.env:
            for ref in re.findall(r"\$\((\w+)\)", value or ""):
                assert ref in defined, f"{container.name}: {key} uses $({ref}) before it is defined"
            defined.add(key)


@pytest.mark.parametrize("source", SOURCES)
def test_services_agree_with_each_other(containers, source):
    by_name: dict[str, dict[str, str | None]] = {}
    for container in containers[source]:
        # Of several inference deployments the first is the default, the one the others agree with.
        by_name.setdefault(container.name, _effective(container))
    gateway, inference, trainer = by_name["gateway"], by_name["inference"], by_name["trainer"]
    served = inference.get("LOOPLINE_SERVED_MODEL_NAME") or inference["LOOPLINE_MODEL"]
    assert gateway["LOOPLINE_MODEL"] == served, "the gateway's default model is not the one served"
    assert trainer["LOOPLINE_MODEL"] == inference["LOOPLINE_MODEL"], "training would adapt another model"
    assert trainer["LOOPLINE_JOBS_DIR"] == by_name["checkpoint-watcher"]["LOOPLINE_JOBS_DIR"]
    assert gateway["LOOPLINE_HOST"] == "0.0.0.0", "the gateway would listen on loopback only"
    # sbatch hands the trainer's environment to each job: the compute node must have its paths.
    compute = next(c for c in containers[source] if c.name in ("slurm-compute", "slurmd"))
    for var in ("LOOPLINE_JOBS_DIR", "LOOPLINE_MODELS_DIR"):
        assert trainer[var] in compute.mounts, f"the compute node does not mount {var}={trainer[var]}"


@pytest.mark.parametrize("source", SOURCES)
def test_gateway_reads_the_api_keys_it_is_given(containers, source):
    """The chart gives the gateway API keys from a Secret (LOOPLINE_API_KEYS), compose a keys file
    (LOOPLINE_API_KEYS_FILE): the gateway's settings must read the variable it is given, or the keys
    protect nothing, and every deployment gives it one by default."""
    names = set(settings_env_names(settings_module.GatewaySettings))
    assert {"LOOPLINE_API_KEYS", "LOOPLINE_API_KEYS_FILE"} <= names, "GatewaySettings reads no API keys"
    gateway = next(_effective(c) for c in containers[source] if c.name == "gateway")
    given = {"LOOPLINE_API_KEYS", "LOOPLINE_API_KEYS_FILE"} & set(gateway)
    assert given, f"{source} gives the gateway no API keys: it would come up open"
