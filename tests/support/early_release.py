"""Session-scoped stacks stopped right after the last test that uses them, not at the session's end.

pytest finalizes a session fixture only when the session ends. The e2e session stacks (tests/e2e/
conftest.py: the tiny stack, two deployments, Slurm, Tinker; five engines of ~1.8 GB each) are last
used at item 123 of the stacks lane's 446, yet were held until its end: on a `make test` run, three
engines alive from 270 s to 1,920 s, and the machine down to 2.3 GB available when the other lane
started one more engine.

A fixture hands its stop here (``release_after_last_use``). After each test's teardown, the hook
``pytest_runtest_teardown`` (tests/conftest.py takes it in) stops every held fixture that no later
test of the run needs, directly or through the fixtures it needs. The fixture's own teardown still
runs at the session's end, so each stop must be safe to call twice (LocalStack.stop and the tinker
SDK's ServiceClient.close are).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

_held: dict[str, Callable[[], None]] = {}
_last_use: dict[str, int] = {}
_position: dict[int, int] = {}  # id(item) -> its index in the run


def release_after_last_use(request: pytest.FixtureRequest, stop: Callable[[], None]) -> None:
    """Stop this fixture's value with ``stop`` once no later test needs it."""
    _held[request.fixturename] = stop


def last_uses(items: Sequence[pytest.Item]) -> dict[str, int]:
    """Each fixture name -> the index of the last item that needs it."""
    last: dict[str, int] = {}
    for index, item in enumerate(items):
        for name in getattr(item, "fixturenames", ()):
            last[name] = index
    return last


def release_unused(item: pytest.Item) -> list[str]:
    """Stop what no test after ``item`` needs; returns the names stopped."""
    if not _position:
        _last_use.update(last_uses(item.session.items))
        _position.update((id(it), index) for index, it in enumerate(item.session.items))
    position = _position[id(item)]
    # Last held, first stopped, as pytest finalizes: a client before the stack it talks to.
    released = [name for name in reversed(_held) if _last_use.get(name, -1) <= position]
    for name in released:
        _held.pop(name)()
    return released


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test's own teardown, stop what no later test needs."""
    result = yield
    if nextitem is not None:  # after the last test, pytest's own teardown has just stopped them all
        release_unused(item)
    return result
