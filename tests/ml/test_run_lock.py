"""One run of a job at a time: a training program started while another run of the same job still
holds its run lock (Slurm declared its node down, or it is still checkpointing after a stop) waits,
and starts once that run is gone, even when it was killed with SIGKILL. Real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loopline.common.contracts.job_layout import EVENTS_FILE, RUN_LOCK_FILE, STATUS_FILE

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


def test_a_run_whose_job_the_run_before_completed_exits_without_a_word(tmp_path):
    """The run before finished the job while this one waited (its node declared down, it trained on
    to the end): the real program exits 0 and adds nothing to the job's files. A job left unfinished
    is taken up (here it has no config, so it fails, saying so)."""
    status = {"status": "COMPLETED", "step": 40, "max_steps": 40}
    (tmp_path / STATUS_FILE).write_text(json.dumps(status))
    (tmp_path / EVENTS_FILE).write_text('{"kind": "completed", "step": 40}\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    program = [sys.executable, "-m", "loopline.ml.train", "--job-dir", str(tmp_path)]
    done = subprocess.run(program, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"the run before completed this job" in done.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != RUN_LOCK_FILE} == before

    (tmp_path / STATUS_FILE).write_text(json.dumps({**status, "status": "TRAINING", "step": 12}))
    taken_up = subprocess.run(program, capture_output=True, timeout=120)
    assert taken_up.returncode == 1, taken_up.stderr[-2000:]
    assert json.loads((tmp_path / EVENTS_FILE).read_text().splitlines()[-1])["kind"] == "failed"
