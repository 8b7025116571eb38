"""The test tiers, as markers put on each collected test by what it starts, so that no test has to
remember its tier and a new one lands in the right one (the markers are listed in pyproject.toml and
README "Tests"):

- ``stack``: a whole platform (tests/e2e: nats-server, the five services, vLLM) or ``make up``;
- ``slurm``: the private Slurm cluster (the ``slurm`` fixture, or a ``launcher_kind`` of slurm);
- ``chaos`` and ``soak``: processes killed at random under load, and the soak run;
- ``slow``: a test that takes long on its own (marked by hand where it is written);
- ``smollm2`` and ``postgres``: the real SmolLM2 model, a PostgreSQL server (marked where written);
- ``compose``: tests/compose, docker-compose.yml built and run on podman (``make compose-test``).

``make test-fast`` deselects all of them; ``make test`` (CI) runs everything but ``compose``, in two
lanes (LANES). ``compose`` runs only when asked for by name (``-m compose``): it builds every image
(minutes, gigabytes) and needs root for podman, so a plain ``pytest`` leaves it out too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# Every marker that puts a test outside the fast tier.
SLOW_TIERS = ("stack", "slurm", "chaos", "soak", "slow", "smollm2", "postgres", "compose")
# `make test` runs two pytest processes at once (scripts/test_lanes.py): the tests that start whole
# stacks or daemons, and everything else (the fast tier, `slow` and `postgres`: tests of one
# process or function, waiting much of their time).
STACK_TIERS = ("stack", "slurm", "chaos", "soak", "smollm2")
# The cookbook recipe matrix and the model families' stack start stacks but run in the in-process
# lane: ~20 recipes of ~20 s, and five engines with 15 jobs, would lengthen the stacks lane, the
# longer one (1287 s against 854 s at c9b5916; 1389 s against 1128 s at 7d88831).
_STACKS = " or ".join(STACK_TIERS)
_MOVED = "recipes or families"
LANES = {"stacks": f"({_STACKS}) and not ({_MOVED}) and not compose",
         "in-process": f"(not ({_STACKS}) or {_MOVED}) and not compose"}


def mark_tiers(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
        if parts[:1] == ("e2e",):
            item.add_marker(pytest.mark.stack)
        if parts[:1] == ("compose",):
            item.add_marker(pytest.mark.compose)
        if path.name.startswith("test_chaos"):
            item.add_marker(pytest.mark.chaos)
        if path.name == "test_soak.py":
            item.add_marker(pytest.mark.soak)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "slurm" in getattr(item, "fixturenames", ()) or params.get("launcher_kind") == "slurm":
            item.add_marker(pytest.mark.slurm)


def asked_for_compose(config: pytest.Config) -> bool:
    """Whether this run's ``-m`` names the compose tier (the only way it runs)."""
    return "compose" in (config.getoption("markexpr", "") or "").replace("not compose", "")


def leave_out_compose(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the compose tier unless asked for (see the module's docstring)."""
    if asked_for_compose(config):
        return
    left_out = [item for item in items if item.get_closest_marker("compose") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker("compose") is None]
