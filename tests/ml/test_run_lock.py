"""One run of a job at a time: a training program started while another run of the same job still
holds its run lock (Slurm declared its node down, or it is still checkpointing after a stop) waits,
and starts once that run is gone, even when it was killed with SIGKILL. Real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loopline.common.contracts.job_layout import RUN_LOCK_FILE

HOLD = ("import fcntl, sys, time\n"
        "lock = open(sys.argv[1], 'ab'); fcntl.lockf(lock, fcntl.LOCK_EX)\n"
        "print('holding', flush=True); time.sleep(120)\n")
WAIT = ("import logging, sys\n"
        "from pathlib import Path\n"
        "from loopline.ml.train.__main__ import wait_for_the_run_before\n"
        "wait_for_the_run_before(Path(sys.argv[1]), logging.getLogger('test'))\n"
        "print('running', flush=True)\n")


def test_a_second_run_waits_until_the_first_is_killed(tmp_path):
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / RUN_LOCK_FILE)],
                             stdout=subprocess.PIPE)
    second = None
    try:
        assert first.stdout is not None and first.stdout.readline() == b"holding\n"
        second = subprocess.Popen([sys.executable, "-c", WAIT, str(tmp_path)], stdout=subprocess.PIPE)
        with pytest.raises(subprocess.TimeoutExpired):
            second.wait(timeout=3)  # ample for a start: it must still be waiting after it
        first.kill()  # kill -9: the kernel drops the dead process's lock
        first.wait()
        assert second.wait(timeout=30) == 0
        assert second.stdout is not None and second.stdout.read() == b"running\n"
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_run_alone_does_not_wait(tmp_path):
    alone = subprocess.run([sys.executable, "-c", WAIT, str(tmp_path)], capture_output=True, timeout=30)
    assert alone.returncode == 0 and alone.stdout == b"running\n", alone.stderr[-2000:]
