"""Tinker is one vertical slice: only the gateway and the session worker speak it, so only they
install the SDK (``tinker``, and ``zstandard`` for its compressed bodies). The shared library, the
queue, the checkpoint-watcher, the inference replicas and the trainer neither depend on it nor
import it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from support.deploy import ROOT

SDK = {"tinker", "zstandard"}
SPEAKERS = {"loopline-gateway", "loopline-tinker-worker"}


def _dependencies() -> dict[str, set[str]]:
    """Each of our packages -> the names of what it requires."""
    out = {}
    for pyproject in [ROOT / "libs/common/pyproject.toml", *ROOT.glob("services/*/pyproject.toml"),
                      ROOT / "ml/pyproject.toml", ROOT / "cli/pyproject.toml"]:
        project = tomllib.loads(pyproject.read_text())["project"]
        out[project["name"]] = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower()
                                for r in project.get("dependencies", [])}
    return out


def test_only_the_gateway_and_the_session_worker_require_the_sdk():
    packages = _dependencies()
    assert set(packages) >= SPEAKERS
    assert {name for name, needs in packages.items() if needs & SDK} == SPEAKERS
    # ... and nothing else gets it through one of ours.
    for name, needs in packages.items():
        if name not in SPEAKERS:
            assert not needs & SPEAKERS, f"{name} requires {needs & SPEAKERS}"


@pytest.mark.parametrize("service", ["loopline.queue.service", "loopline.checkpoint_watcher.service",
                                     "loopline.inference.service", "loopline.trainer.service"])
def test_the_other_services_do_not_import_the_sdk(service):
    probe = (f"import sys, {service}; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'tinker', 'zstandard'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
