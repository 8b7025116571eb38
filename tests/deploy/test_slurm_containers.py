"""deploy/slurm/loopline-slurm and deploy/slurm/slurm.conf with the real Slurm daemons, laid out as
the compose stack lays out its containers (tests/deploy/slurm_containers.sh): a controller running as
the slurm user, a root compute node that registers itself, a trainer submitting as uid 10001 into
the shared job directory; and with stand-in GPU devices, one GPU per task."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from support.deploy import ROOT
from support.root import in_ci

# Slurm daemons in namespaces, per GPU count (~7 s): out of the edit loop.
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "deploy" / "slurm_containers.sh"


def _why_not() -> tuple[str, bool] | None:
    """Why this cannot run here, and whether that is Slurm's absence (which CI does not accept)."""
    why = _slurm_missing()
    if why:
        return why, True
    for tool in ("unshare", "nsenter", "ip", "setpriv", "pgrep"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed", False
    argv = ["unshare", "--mount", "--net", "--pid", "--uts", "--fork", "--mount-proc", "true"]
    probe = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"this machine refuses new namespaces: {probe.stderr.strip()}", False
    return None


def _slurm_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (namespaces, slurmd)"
    for tool in ("sbatch", "sinfo", "scontrol"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Slurm: scripts/slurm/install.sh)"
    for daemon in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"):
        if not os.path.exists(daemon):
            return f"{daemon} is missing (scripts/slurm/install.sh)"
    return None


@pytest.mark.parametrize("gpus", [0, 2])
def test_slurm_containers(gpus):
    why = _why_not()
    if why:
        reason, slurm_missing = why
        # CI installs Slurm (make slurm) and sets LOOPLINE_REQUIRE_SLURM=1, like tests/conftest.py;
        # it runs as root on a machine that allows namespaces: a skip there would hide the test.
        if slurm_missing and os.environ.get("LOOPLINE_REQUIRE_SLURM") == "1":
            pytest.fail(f"LOOPLINE_REQUIRE_SLURM=1 but {reason}")
        if in_ci():
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    out = subprocess.run(["bash", str(SCRIPT), str(gpus)], check=False, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0 and "slurm containers: ok" in out.stdout, \
        out.stdout[-4000:] + out.stderr[-2000:]
