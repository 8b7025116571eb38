"""``make up``'s supervision of its inference replicas: one that exits is started again, with backoff.

A replica exits when it can serve no more: its vLLM engine died (the replica's engine watch), one of
its loops died, it lost NATS for good (the runtime's exit policy, exit 1). Its requests went back to
JetStream for the other replicas; a fresh process loads the model again and serves. Compose
(``restart: unless-stopped``) and Kubernetes (a Deployment's pods always restart) do the same.

Not restarted: a replica that refused to start (exit 2, the runtime's EXIT_START_REFUSED: an
untested vLLM, a setting it cannot work with) would refuse again, so it stops the stack as any other
process's exit does, with its log's last lines.

Backoff: the first restart waits ``first_s``; each exit within ``settle_s`` of the replica's last
start doubles the wait, up to ``max_s``, so a replica that dies at once (a model whose engine dies on
its first request) costs a load a minute, not a loop of loads; one that served for ``settle_s``
starts its count again.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from loopline.common.local import launcher
from loopline.common.local.stack import LocalStack
from loopline.common.runtime.service import EXIT_START_REFUSED

FIRST_S = 1.0
MAX_S = 60.0
SETTLE_S = 60.0


def say(line: str) -> None:
    print(f"loopline up: {line}", file=sys.stderr, flush=True)


@dataclass
class _Replica:
    started: float  # when its current process started (the supervisor's clock)
    quick_exits: int = 0  # exits in a row, each within settle_s of its start
    due: float | None = None  # when a restart is due, while its process is dead


class ReplicaRestarts:
    def __init__(self, stack: LocalStack, *, first_s: float = FIRST_S, max_s: float = MAX_S,
                 settle_s: float = SETTLE_S, clock: Callable[[], float] = time.monotonic,
                 report: Callable[[str], None] = say):
        self.stack = stack
        self.first_s, self.max_s, self.settle_s = first_s, max_s, settle_s
        self.clock, self.report = clock, report
        self.replicas = {name: _Replica(started=clock()) for name in stack.inference}
        self.restarts = 0  # how many replicas it started again, in all

    def delay(self, quick_exits: int) -> float:
        """The wait before the restart after ``quick_exits`` quick exits in a row (1 or more)."""
        return min(self.max_s, self.first_s * 2 ** (quick_exits - 1))

    def check(self) -> list[launcher.Proc]:
        """Start again the replicas whose wait is over, schedule the ones that just exited, and
        return the processes that ended for good: every other service's, and a replica's that
        refused to start. The stack cannot go on without those."""
        now = self.clock()
        fatal = [p for p in self.stack.dead() if p not in self.stack.inference.values()]
        # Invariant: every replica before this one is alive, restarted, waiting out its backoff, or
        # (refused to start) in ``fatal``.
        for name, proc in list(self.stack.inference.items()):
            state = self.replicas.setdefault(name, _Replica(started=now))
            if proc.alive():
                if now - state.started >= self.settle_s:
                    state.quick_exits = 0
                continue
            code = proc.popen.returncode
            if code == EXIT_START_REFUSED:
                fatal.append(proc)
                continue
            if state.due is None:
                quick = now - state.started < self.settle_s
                state.quick_exits = state.quick_exits + 1 if quick else 1
                wait = self.delay(state.quick_exits)
                state.due = now + wait
                tail = "\n".join(f"  {line}" for line in proc.log_tail(8).splitlines())
                self.report(f"replica {name} exited with {code}; starting it again in {wait:.0f} s "
                            f"({state.quick_exits} quick exit(s) in a row; log {proc.log_path}):\n{tail}")
            elif now >= state.due:
                fresh = self.stack.restart_replica(name, kill=False)
                state.started, state.due = now, None
                self.restarts += 1
                self.report(f"replica {name} started again (pid {fresh.pid}); it serves once its "
                            "model is loaded")
        return fatal
