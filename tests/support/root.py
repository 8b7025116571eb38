"""Tests that only root can run (dropping a job to another uid, chown): skipped elsewhere on a
developer's machine, but a failure under CI (``CI=true``), where a skip would hide that the
privilege drop was never tested."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def need_root(why: str = "only root can drop a job to another uid") -> None:
    """Call first in a test that needs root."""
    if os.geteuid() == 0:
        return
    if in_ci():
        pytest.fail(f"CI=true but this test needs root ({why}); run the suite as root in CI")
    pytest.skip(why)
