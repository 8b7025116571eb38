"""`make test`: the whole suite as two pytest processes at once, one lane for the tests that start
whole stacks (vLLM engines, Slurm, chaos, soak) and one for everything else (tests/support/tiers.py
LANES), so that the in-process tests run while the stacks' tests wait on engines and daemons.

Why two processes: run one after the other on this 2-core machine, the in-process lane took ~500 s
and was about half waiting (timeouts, polls, redeliveries); the stacks' lane leaves a core idle
for much of its ~1,300 s. Both lanes share the checkout's prepared models (built here first, so they
never race to build them) and the cookbook's venv (its install starts here, in the background, and
the tests that need it wait on its lock).

The stacks' lane prints as it goes; the other lane's output goes to a log (named at start) and is
printed when both are done. Last come a few lines that CI's tail keeps: each lane's outcome, its
failures and last progress line, and what the machine did meanwhile (support/lane_watch.py). Lanes past
DEADLINE_S are interrupted. The exit status is the first failing lane's; "no test selected" in one
lane (arguments that pick tests from the other) is not a failure.

    python scripts/test_lanes.py [pytest arguments...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.lane_watch import MachineWatch  # noqa: E402
from support.tiers import LANES  # noqa: E402

NO_TESTS_COLLECTED = 5  # pytest's exit status when a selection is empty
# Both lanes' torch and vLLM processes (engines, training, references) want every core at once, and
# OpenMP's threads spin while they wait for work by default, taking the cores the other processes
# need. Measured on this 2-core machine, a small matmul loop in two processes at once: 820 it/s
# each spinning, 5,280 passive (alone: 8,370 and 3,470). A user's own setting wins.
THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# CI stops a run at 5,400 s, setup included (270 s before the lanes at stop 40), and then keeps only
# the tail of its output. Lanes still running at the deadline are interrupted, so that they print
# their summaries and durations, and this script its own last lines, before that: 270 + 4,800 + 90
# s of grace leaves a minute. LOOPLINE_LANES_DEADLINE_S overrides.
DEADLINE_S = 4_800.0
INTERRUPT_GRACE_S = 90.0


def prepare_models() -> None:
    """Build the tiny models both lanes load, once, before either starts."""
    from loopline.ml.models.families import FAMILIES
    from loopline.ml.models.resolve import resolve_model
    from support.stacks import MODELS_DIR

    for name in ("tiny", "tiny-embed", *FAMILIES):
        resolve_model(name, MODELS_DIR)


def start_cookbook_install(log_dir: Path) -> subprocess.Popen[bytes]:
    """The cookbook venv's install (~50 s on a fresh machine) in the background: the stacks' lane
    reaches its cookbook tests minutes later and finds it done (support/cookbook.py takes the same
    lock, so it waits rather than installs twice)."""
    code = "from support.cookbook import cookbook_python; cookbook_python()"
    with open(log_dir / "cookbook-install.log", "wb") as out:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO / "tests")})


def tee(source, log: Path) -> threading.Thread:
    """Copy a lane's output to this process's stdout as it comes, and to ``log``."""
    def copy() -> None:
        with open(log, "wb") as out:
            while chunk := source.read1(65536):
                out.write(chunk)
                out.flush()
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
    thread = threading.Thread(target=copy, name="tee", daemon=True)
    thread.start()
    return thread


def last_progress(log: Path) -> str:
    """The lane's last progress line (a test file and its results so far): where it was at the end."""
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if line.startswith("tests/") and "::" not in line.split(" ")[0]]  # not a warning's test
    return lines[-1][:120] if lines else "(no test started)"


def failures(log: Path) -> list[str]:
    """The lane's "short test summary" lines, for the run's last lines."""
    return [line[:200] for line in log.read_text(errors="replace").splitlines()
            if line.startswith(("FAILED ", "ERROR "))]


def main(args: list[str]) -> int:
    log_dir = REPO / ".loopline" / "test-lanes"
    log_dir.mkdir(parents=True, exist_ok=True)
    prepare_models()
    install = start_cookbook_install(log_dir)
    (stacks, stacks_marks), (other, other_marks) = LANES.items()
    logs = {stacks: log_dir / f"{stacks}.log", other: log_dir / f"{other}.log"}
    print(f"[lanes] {stacks!r} lane here; {other!r} lane in {logs[other]}", flush=True)
    deadline_s = float(os.environ.get("LOOPLINE_LANES_DEADLINE_S", DEADLINE_S))
    watch = MachineWatch(log_dir / "machine.log")
    watch.start()
    started = time.monotonic()
    pytest = [sys.executable, "-m", "pytest"]
    env = {**THREAD_ENV, **os.environ}
    with open(logs[other], "wb") as out:
        lanes = {
            stacks: subprocess.Popen([*pytest, "-m", stacks_marks, *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
            other: subprocess.Popen([*pytest, "-m", other_marks, *args], cwd=REPO, env=env,
                                    stdout=out, stderr=subprocess.STDOUT),
        }
        copier = tee(lanes[stacks].stdout, logs[stacks])

        def stop(signum, _frame):
            for proc in lanes.values():
                proc.send_signal(signum)

        signal.signal(signal.SIGTERM, stop)
        took: dict[str, float] = {}
        interrupted_at: float | None = None
        # Invariant: ``took`` holds every lane that has exited; past the deadline, every lane left
        # has been sent SIGINT (pytest then prints its summary and durations), and SIGKILL after
        # INTERRUPT_GRACE_S more.
        while len(took) < len(lanes):
            now = time.monotonic() - started
            for name, proc in lanes.items():
                if name not in took and proc.poll() is not None:
                    took[name] = now
                    print(f"\n[lanes] {name!r} lane ended (exit {proc.returncode}) after {now:.0f} s",
                          flush=True)
            if interrupted_at is None and now > deadline_s:
                interrupted_at = now
                print(f"\n[lanes] past the {deadline_s:.0f} s deadline: interrupting "
                      f"{[name for name in lanes if name not in took]}", flush=True)
                for name, proc in lanes.items():
                    if name not in took:
                        proc.send_signal(signal.SIGINT)
            elif interrupted_at is not None and now > interrupted_at + INTERRUPT_GRACE_S:
                for name, proc in lanes.items():
                    if name not in took:
                        proc.kill()
            time.sleep(1)
        copier.join(timeout=10)
    install.wait()
    watch.stop()
    print(f"\n[lanes] ===== {other!r} lane's output =====", flush=True)
    sys.stdout.buffer.write(logs[other].read_bytes())
    # The last lines are what CI keeps: the outcome, what failed, where each lane was, the machine.
    print("\n[lanes] " + ", ".join(f"{name}: exit {proc.returncode} in {took[name]:.0f} s"
                                     for name, proc in lanes.items()), flush=True)
    for name, log in logs.items():
        for line in failures(log):
            print(f"[lanes] {name}: {line}")
        print(f"[lanes] {name} was last at: {last_progress(log)}")
    if interrupted_at is not None:
        print(f"[lanes] interrupted: still running past the {deadline_s:.0f} s deadline")
    for line in watch.summary():
        print(f"[lanes] {line}", flush=True)
    codes = [proc.returncode for proc in lanes.values()]
    if interrupted_at is not None:
        return 1
    if all(code == NO_TESTS_COLLECTED for code in codes):
        return NO_TESTS_COLLECTED
    return next((code for code in codes if code not in (0, NO_TESTS_COLLECTED)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
