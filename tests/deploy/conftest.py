"""Session fixtures for the deployment checks; the helpers are in tests/support/deploy.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from loopline.common.runtime import nats_auth, nats_permissions
from support.deploy import CHART_VALUES, COMPOSE_STACKS, ROOT, Tools, compose_config, render_chart


@pytest.fixture(scope="session")
def tools() -> Tools:
    out = subprocess.run(["bash", str(ROOT / "deploy" / "install-tools.sh")], check=False,
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    if out.returncode != 0:
        pytest.fail(f"deploy/install-tools.sh failed:\n{out.stderr[-3000:]}")
    venv = Path(out.stdout.strip().splitlines()[-1])
    return Tools(venv if venv.is_absolute() else ROOT / venv)


# docker-compose.yml requires a NATS password per role (the .env `nats_auth env` writes); the
# rendered configs are checked with these, which tests/deploy/test_nats_auth.py looks for.
COMPOSE_NATS_PASSWORDS = {nats_auth.password_variable(role): f"pw{role.replace('-', '')}0"
                          for role in nats_permissions.ROLES}
for _variable, _password in COMPOSE_NATS_PASSWORDS.items():
    os.environ.setdefault(_variable, _password)  # every `docker compose config` here needs them
# The user-code override requires a database password of the operator's own.
os.environ.setdefault("POSTGRES_PASSWORD", "pwpostgres0")


@pytest.fixture(scope="session")
def compose_nats_passwords() -> dict[str, str]:
    return dict(COMPOSE_NATS_PASSWORDS)


@pytest.fixture(scope="session")
def compose_stacks(tools) -> dict[str, dict]:
    return {name: compose_config(tools, files) for name, files in COMPOSE_STACKS.items()}


@pytest.fixture(scope="session")
def charts(tools) -> dict[str, dict]:
    return {name: render_chart(tools, files) for name, files in CHART_VALUES.items()}
