"""docker-compose.yml (and the GPU override) as a real Compose v2 implementation reads them."""

from __future__ import annotations

import re

import pytest

from support.deploy import COMPOSE, COMPOSE_GPU, COMPOSE_STACKS, DOCKERFILE, ROOT, dockerfile_stages

TRAINING = ("trainer", "slurm-compute", "checkpoint-watcher")
SLURM = ("slurmctld", "slurm-compute", "trainer")
JOBS = "/var/lib/loopline/jobs"


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
def test_compose_config_validates(tools, stack):
    argv = [tools.compose, "--project-directory", str(ROOT)]
    for file in COMPOSE_STACKS[stack]:
        argv += ["-f", str(file)]
    out = tools.run(*argv, "config", "--quiet")
    assert out.returncode == 0, out.stderr


BROKEN = {
    # Each edit turns the real file into one Compose must refuse.
    "depends on a service that does not exist": ("      queue:\n        condition: service_started",
                                                 "      qeueu:\n        condition: service_started"),
    "a key Compose does not know": ("    stop_grace_period: 30s", "    stop_grace_periodd: 30s"),
    "a named volume that is not declared": ("      - jobs:/var/lib/loopline/jobs\n      - models",
                                            "      - jbos:/var/lib/loopline/jobs\n      - models"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_compose_rejects_a_broken_file(tools, tmp_path, case):
    old, new = BROKEN[case]
    text = COMPOSE.read_text()
    assert old in text, f"the edit for {case!r} no longer applies to docker-compose.yml"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    out = tools.run(tools.compose, "--project-directory", str(ROOT), "-f", str(broken), "config", "--quiet")
    assert out.returncode != 0, f"compose accepted a file with {case}"


def test_every_service_of_the_stack_is_there(compose_stacks):
    services = set(compose_stacks["compose"]["services"])
    assert {"nats", "postgres", "gateway", "queue", "inference", "trainer", "slurmctld",
            "slurm-compute", "checkpoint-watcher"} <= services


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
def test_inference_replicas_restart_when_they_exit(compose_stacks, stack):
    """A replica whose vLLM engine died exits 1; Compose must start it again."""
    replicas = {name: service for name, service in compose_stacks[stack]["services"].items()
                if name.startswith("inference")}
    assert replicas
    for name, service in replicas.items():
        assert service.get("restart") in ("always", "unless-stopped", "on-failure"), name


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
def test_built_images_are_dockerfile_targets(compose_stacks, stack):
    stages = dockerfile_stages(DOCKERFILE.read_text())
    for name, service in compose_stacks[stack]["services"].items():
        build = service.get("build")
        if not build:
            continue
        target = build["target"]
        assert target in stages, f"{name}: no target {target} in the Dockerfile"
        assert build["dockerfile"].endswith("deploy/docker/Dockerfile")
        assert re.search(rf"/{re.escape(target)}:[^/]+$", service["image"]), \
            f"{name}: image {service['image']} is not named after its target {target}"


def _mounts(service: dict) -> dict[str, dict]:
    return {v["target"]: v for v in service.get("volumes", [])}


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
def test_job_directories_are_one_volume_at_one_path(compose_stacks, stack):
    services = compose_stacks[stack]["services"]
    for name in TRAINING:
        mount = _mounts(services[name]).get(JOBS)
        assert mount and mount["type"] == "volume" and mount["source"] == "jobs", \
            f"{name} does not mount the jobs volume at {JOBS}"
    for name in ("trainer", "checkpoint-watcher"):
        assert services[name]["environment"]["LOOPLINE_JOBS_DIR"] == JOBS


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
def test_slurm_containers_share_config_and_munge_key(compose_stacks, stack):
    services = compose_stacks[stack]["services"]
    for name in SLURM:
        mounts = _mounts(services[name])
        conf = mounts.get("/etc/slurm/slurm.conf")
        assert conf and conf["source"].endswith("deploy/slurm/slurm.conf") and conf.get("read_only")
        key = mounts.get("/etc/munge-key")
        assert key and key["source"] == "munge-key" and key.get("read_only"), name
    assert services["munge-key"]["command"][0] == "genkey"
    assert services["slurmctld"]["depends_on"]["munge-key"]["condition"] == "service_completed_successfully"
    # slurmctld checks it runs on the host slurm.conf names.
    conf = (ROOT / "deploy/slurm/slurm.conf").read_text()
    host = re.search(r"^SlurmctldHost=([^(\s]+)", conf, re.MULTILINE).group(1)
    assert services["slurmctld"]["hostname"] == host


def test_persistent_state_is_on_volumes(compose_stacks):
    services = compose_stacks["compose"]["services"]
    assert _mounts(services["nats"])["/data"]["type"] == "volume"
    assert "-js" in services["nats"]["command"]
    assert _mounts(services["postgres"])["/var/lib/postgresql/data"]["type"] == "volume"
    assert _mounts(services["slurmctld"])["/var/spool/slurmctld"]["type"] == "volume"


def test_gpu_override_gives_inference_and_compute_gpus(compose_stacks):
    services = compose_stacks["compose+gpu"]["services"]
    for name, target in (("inference", "inference-gpu"), ("slurm-compute", "slurm-compute-gpu"),
                         ("trainer", "trainer-gpu")):
        assert services[name]["build"]["target"] == target
    for name in ("inference", "slurm-compute"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
    # The override must not lose what the base file sets.
    assert services["inference"]["environment"]["LOOPLINE_NATS_URL"].startswith("nats://inference:")
    assert COMPOSE_GPU.exists()
