"""`python -m loopline.ml.train --job-dir DIR`: run (or resume) the training job in DIR.

Exit status: 0 completed; 143 stopped by SIGTERM after checkpointing (status stays TRAINING,
so the trainer requeues it); 1 failed (status FAILED, a `failed` event with the error).
Logs go to stderr (Slurm's output file); the job's state is in DIR/status.json and events.jsonl.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from loopline.common.contracts.job_layout import RUN_LOCK_FILE

from .exit_codes import EXIT_COMPLETED, EXIT_FAILED

if TYPE_CHECKING:
    from loopline.common.contracts.train_params import JobConfig

    from .status import JobReporter


# What a job's training is: (job_dir, config, reporter, stop_requested) -> exit status.
RunJob = Callable[[Path, "JobConfig", "JobReporter", Callable[[], bool]], int]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loopline.ml.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job-dir", type=Path, required=True,
                        help="folder with config.json and dataset.jsonlines; outputs are written there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_program(args.job_dir)


def run_program(job_dir: Path, run_job: RunJob | None = None) -> int:
    """Run the job in ``job_dir`` with ``run_job`` (the training loop, ``loop.run_job``, unless a
    test's stand-in program passes its own): SIGTERM asks it to stop, a failure ends the job FAILED
    with its reason."""
    log = logging.getLogger("loopline.ml.train")

    # Slurm sends TERM before a time limit or on preemption: finish the step, checkpoint, exit 143.
    # Installed first, so a TERM that arrives while the model loads is not lost either.
    stop = {"requested": False}

    def on_term(signum, frame):
        if not stop["requested"]:
            log.warning("SIGTERM: stopping after the current step")
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_term)

    job_dir = job_dir.resolve()
    if not job_dir.is_dir():
        log.error("job directory %s does not exist", job_dir)
        return EXIT_FAILED

    # Held until the process ends (kill -9 included: the kernel drops a dead process's locks).
    run_lock = wait_for_the_run_before(job_dir, log)  # noqa: F841 - held by being open

    # Imported after the handler is in place: torch and transformers take seconds to import.
    from loopline.common.contracts.train_params import JobConfig

    from .status import JobReporter, read_status

    # The run before may have finished the job after all: its node was declared down, the trainer
    # submitted this run, and the old program still trained to the end before anything stopped it
    # (CI, stop 38: a second "started" and "completed" followed the first "completed"). Nothing is
    # left to do, and a word more on the job's stream would be news that is not.
    if (read_status(job_dir) or {}).get("status") == "COMPLETED":
        log.info("the run before completed this job: nothing left to do")
        return EXIT_COMPLETED

    if run_job is None:
        from .loop import run_job as training_loop

        run_job = training_loop

    reporter = JobReporter(job_dir)
    try:
        config = JobConfig.read(job_dir)
        return run_job(job_dir, config, reporter, lambda: stop["requested"])
    except Exception as exc:  # noqa: BLE001 - any failure ends the job as FAILED with its reason
        log.error("training failed:\n%s", traceback.format_exc())
        error = f"{type(exc).__name__}: {exc}"
        reporter.write(status="FAILED", error=error)
        reporter.event("failed", error=error, step=reporter.status["step"])
        return EXIT_FAILED
    finally:
        reporter.close()


def wait_for_the_run_before(job_dir: Path, log: logging.Logger) -> IO[bytes]:
    """Lock the job's run lock, waiting while another run holds it; the open lock file.

    Slurm lets a new run of a job start while an earlier one still runs: when it declares a node
    down (slurmd silent past SlurmdTimeout) it fails the job at once and the trainer submits the
    next run, but the program on that node is not stopped until its slurmd is back, and then gets
    KillWait to checkpoint (tests/e2e/test_chaos_slurm.py saw two programs of one job alive together
    for 5 s; on a node cut off from the controller it lasts as long as the cut). Two runs writing
    at once would interleave events.jsonl and write checkpoints of the same steps. Waiting here,
    before anything is read or written, makes the new run resume from what the old one left once
    it is gone. A POSIX lock (not flock) so it also holds between nodes on NFS."""
    lock = open(job_dir / RUN_LOCK_FILE, "ab")  # noqa: SIM115 - open for the process's life
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        log.warning("another run of this job still runs (its node was declared down, or it is still "
                    "checkpointing after a stop): waiting for it to end")
        fcntl.lockf(lock, fcntl.LOCK_EX)
        log.info("the run before ended; starting from what it left")
    return lock


if __name__ == "__main__":
    sys.exit(main())
