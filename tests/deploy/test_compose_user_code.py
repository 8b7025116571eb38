"""Who may run what in the compose stacks: the base file keeps a job's own ml/ code off (its trainer
is uid 10001); deploy/compose/docker-compose.user-code.yml turns it on with a root trainer holding
only the capabilities that giving each job a uid of its own needs; and only the containers that
run munged as a user of their own may read the munge key. `make compose-test` runs the override for
real (tests/compose/test_compose_up.py)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from support.deploy import COMPOSE, COMPOSE_STACKS, COMPOSE_USER_CODE, ROOT

TRAINER_CAPABILITIES = {"CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID"}


def _munge_key_gid() -> str:
    script = (ROOT / "deploy/slurm/loopline-slurm").read_text()
    return re.search(r"^MUNGE_KEY_GID=(\d+)$", script, re.MULTILINE).group(1)


@pytest.mark.parametrize("stack", ["compose", "compose+gpu"])
def test_the_base_files_keep_user_code_off_and_the_trainer_unprivileged(compose_stacks, stack):
    trainer = compose_stacks[stack]["services"]["trainer"]
    assert trainer["environment"]["LOOPLINE_ALLOW_USER_CODE"] == "false"
    assert "user" not in trainer, "the trainer runs as its image's user, 10001"


def test_the_override_runs_a_root_trainer_with_only_the_capabilities_it_needs(compose_stacks):
    services = compose_stacks["compose+user-code"]["services"]
    trainer = services["trainer"]
    # Root, so it can give each job a uid of its own; group 10001, which the checkpoint-watcher has,
    # so the job directories (2750, the trainer's group) stay readable to it.
    assert trainer["user"] == "0:10001"
    assert trainer["environment"]["LOOPLINE_ALLOW_USER_CODE"] == "true"
    assert trainer["cap_drop"] == ["ALL"]
    assert set(trainer["cap_add"]) == TRAINER_CAPABILITIES
    assert "no-new-privileges:true" in trainer["security_opt"]
    assert "no-new-privileges:true" in services["slurm-compute"]["security_opt"]
    # The base file's settings are kept: its NATS user, the database, the jobs volume, Slurm.
    assert trainer["environment"]["LOOPLINE_NATS_URL"].startswith("nats://trainer:")
    assert trainer["environment"]["LOOPLINE_LAUNCHER"] == "slurm"
    # Every other service is as the base file has it.
    base = compose_stacks["compose"]["services"]
    for name in ("gateway", "queue", "inference", "checkpoint-watcher", "slurmctld"):
        assert services[name] == base[name], name


def test_the_override_refuses_to_start_without_a_database_password(tools, tmp_path):
    """A job's code reaches the compose network, so PostgreSQL must not keep the default password."""
    argv = [tools.compose, "--project-directory", str(ROOT), "-f", str(COMPOSE), "-f", str(COMPOSE_USER_CODE),
            "config", "--quiet"]
    env = {k: v for k, v in os.environ.items()
           if k != "POSTGRES_PASSWORD" and not k.startswith(("DOCKER_", "COMPOSE_"))}
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "set POSTGRES_PASSWORD" in out.stderr, out.stderr
    # The base file alone still starts with its development default.
    base = subprocess.run([*argv[:5], "config", "--quiet"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert base.returncode == 0, base.stderr


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
def test_only_munged_users_have_the_munge_key_group(compose_stacks, stack):
    """The key is root's, 0440, group MUNGE_KEY_GID (`loopline-slurm genkey`): a container that
    runs munged as a user of its own needs that group (root reads it as its owner). No other
    container gets it, and the compute node, where jobs run, above all."""
    gid = _munge_key_gid()
    services = compose_stacks[stack]["services"]
    assert services["munge-key"]["user"] == "0:0", "genkey chowns the key to root"
    for name, service in services.items():
        has_group = gid in [str(g) for g in service.get("group_add", [])]
        if name not in ("slurmctld", "trainer"):
            assert not has_group, f"{name} has the munge key's group and needs none"
        elif str(service.get("user", "")).split(":")[0] != "0":
            assert has_group, f"{name} runs munged as a user of its own and cannot read the key"
