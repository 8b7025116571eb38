"""``python -m support.kill_loop <package> <loop> <after_s>``: run a Loopline service's real
``main()`` (``<package>.__main__``, e.g. ``loopline.queue``) as its process, except that its named
loop dies ``after_s`` seconds after the service starts serving: the loop's own task is cancelled
where it waits (its ``finally`` blocks run) and then raises RuntimeError("killed by test"), as an
uncaught bug or a lost dependency would. Nothing else is changed: what the process does next is the
runtime's exit policy (loopline.common.runtime.service), which tests/e2e/test_service_exit.py checks.

Run with ``PYTHONPATH`` holding tests/, and the service's ``LOOPLINE_*`` settings.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Awaitable, Mapping

from loopline.common.runtime import service as runtime

KILLED = "killed by test"


async def killed_after(loop: Awaitable[None], after_s: float) -> None:
    """Run ``loop`` in this task; if it is still running after ``after_s``, it dies."""
    try:
        async with asyncio.timeout(after_s):
            await loop
    except TimeoutError as timeout:
        raise RuntimeError(KILLED) from timeout  # its traceback shows where the loop was
    # It ended by itself first: the runtime judges that as it would any loop.


def install(loop_name: str, after_s: float) -> None:
    """Make ``Runtime.serve`` run ``loop_name`` under ``killed_after``."""
    serve = runtime.Runtime.serve

    async def serve_with_a_dying_loop(self: runtime.Runtime, loops: Mapping[str, Awaitable[None]]) -> None:
        if loop_name not in loops:
            raise LookupError(f"{self.role} has no loop {loop_name!r}; its loops: {', '.join(loops)}")
        await serve(self, {**loops, loop_name: killed_after(loops[loop_name], after_s)})

    runtime.Runtime.serve = serve_with_a_dying_loop


def main() -> None:
    package, loop_name, after_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    install(loop_name, after_s)
    sys.argv = [package]
    importlib.import_module(f"{package}.__main__").main()


if __name__ == "__main__":
    main()
