"""``make up``'s supervisor of inference replicas (restarts.py): a replica that exits is started
again after a backoff that doubles while it keeps dying soon after its start, and says so; one that
refused to start, and any other process that exits, stop the stack. Unit level: real processes that
exit with the codes a replica exits with, in a stand-in for LocalStack (restart_replica starts one
more); a fake clock for the backoff. The whole path (a replica whose engine died, started again by
this class, serving) is tests/e2e/test_resilience.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loopline.common.local import launcher
from loopline.common.local.restarts import ReplicaRestarts


def process(tmp_path: Path, name: str, code: int | None) -> launcher.Proc:
    """A process that exits with ``code`` at once, or (None) runs until killed."""
    script = f"import sys; print('{name} ran'); sys.exit({code})" if code is not None else "input()"
    log = tmp_path / f"{name}.log"
    with open(log, "ab") as out:  # in a session of its own, as launcher starts them: kill() kills its group
        popen = subprocess.Popen([sys.executable, "-c", script], stdout=out, stdin=subprocess.PIPE,
                                 start_new_session=True)
    proc = launcher.Proc(name, popen, log)
    if code is not None:
        proc.popen.wait()
    return proc


class Stack:
    """What ReplicaRestarts uses of LocalStack: its replicas, its dead processes, restart_replica."""

    def __init__(self, tmp_path: Path, replicas: dict[str, int | None], others: dict[str, int | None]):
        self.tmp_path = tmp_path
        self.inference = {name: process(tmp_path, name, code) for name, code in replicas.items()}
        self.others = [process(tmp_path, name, code) for name, code in others.items()]
        self.next_exit: int | None = None  # how the next restarted replica ends

    def dead(self) -> list[launcher.Proc]:
        return [p for p in (*self.others, *self.inference.values()) if not p.alive()]

    def restart_replica(self, name: str, *, kill: bool = True) -> launcher.Proc:
        assert not kill and not self.inference[name].alive()
        self.inference[name] = process(self.tmp_path, name, self.next_exit)
        return self.inference[name]

    def stop(self) -> None:
        for proc in (*self.others, *self.inference.values()):
            if proc.alive():
                launcher.kill(proc)


@pytest.fixture
def clock():
    now = [100.0]
    return now


def supervisor(stack: Stack, clock: list[float], said: list[str]) -> ReplicaRestarts:
    return ReplicaRestarts(stack, first_s=1, max_s=8, settle_s=60, clock=lambda: clock[0],
                           report=said.append)


def test_a_replica_that_exits_is_started_again_with_a_backoff_that_doubles(tmp_path, clock):
    stack = Stack(tmp_path, {"r0": None, "r1": None}, {"gateway": None})
    said: list[str] = []
    restarts = supervisor(stack, clock, said)
    try:
        launcher.kill(stack.inference["r0"])
        stack.next_exit = 1  # the fresh one dies at once too
        waits = []
        # Invariant: r0 has exited len(waits) times, each within settle_s of its start.
        for _ in range(5):
            assert restarts.check() == []
            waits.append(float(said[-1].split(" in ")[1].split(" s ")[0]))
            clock[0] += waits[-1] - 0.5
            assert restarts.check() == [] and not stack.inference["r0"].alive()  # not yet due
            old = stack.inference["r0"]
            clock[0] += 0.5
            assert restarts.check() == [] and stack.inference["r0"] is not old
            assert said[-1].startswith("replica r0 started again (pid ")
        assert waits == [1, 2, 4, 8, 8]  # doubling, up to max_s
        assert said[2].startswith("replica r0 exited with 1; starting it again in 2 s")
        assert restarts.restarts == 5 and stack.inference["r1"].alive()
        # One that served settle_s starts its count again.
        stack.next_exit = None
        restarts.check()
        assert "starting it again in 8 s" in said[-1]
        clock[0] += 8
        restarts.check()
        assert stack.inference["r0"].alive()
        clock[0] += 60
        restarts.check()
        launcher.kill(stack.inference["r0"])
        restarts.check()
        assert "starting it again in 1 s" in said[-1]
    finally:
        stack.stop()


def test_a_replica_that_refused_to_start_is_not_restarted(tmp_path, clock):
    stack = Stack(tmp_path, {"r0": 2, "r1": None}, {})
    restarts = supervisor(stack, clock, [])
    try:
        assert restarts.check() == [stack.inference["r0"]]
        assert restarts.restarts == 0
    finally:
        stack.stop()


def test_any_other_process_that_exits_stops_the_stack(tmp_path, clock):
    stack = Stack(tmp_path, {"r0": None}, {"gateway": 1})
    restarts = supervisor(stack, clock, [])
    try:
        assert [p.name for p in restarts.check()] == ["gateway"]
    finally:
        stack.stop()
