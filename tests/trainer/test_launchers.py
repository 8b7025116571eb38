"""The launchers on their own: real Slurm daemons, real local processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loopline.common.contracts.job_layout import ENTRYPOINT_FILE
from loopline.trainer import jobdir
from loopline.trainer.launchers import LaunchSpec, LaunchState, make_launchers
from loopline.trainer.launchers.local import LocalLauncher
from loopline.trainer.launchers.slurm import SlurmLauncher, gpus_in_gres, parse_state, time_limit_minutes


def test_slurm_output_parsing():
    assert parse_state("RUNNING") is LaunchState.RUNNING
    assert parse_state("CANCELLED by 0") is LaunchState.CANCELLED
    assert parse_state("TIMEOUT") is LaunchState.PREEMPTED
    assert parse_state("NODE_FAIL") is LaunchState.PREEMPTED
    assert parse_state("COMPLETING") is LaunchState.RUNNING  # still writing its directory
    assert parse_state("SOMETHING_NEW") is LaunchState.UNKNOWN
    assert gpus_in_gres("gpu:4") == 4
    assert gpus_in_gres("gpu:a100:2(S:0-1),gpu:v100:1,shard:8") == 3
    assert gpus_in_gres("(null)") == 0
    assert time_limit_minutes(24 * 3600) == 24 * 60 + 1
    assert time_limit_minutes(1) == 2


def test_auto_takes_slurm_only_where_a_controller_answers(slurm, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    chosen, every = make_launchers("auto", tmp_path)
    assert chosen.name == "slurm" and set(every) == {"slurm", "local"}
    # Slurm's tools without a cluster (as on CI machines before the tests start one): local.
    monkeypatch.delenv("SLURM_CONF")
    if not Path("/etc/slurm/slurm.conf").exists():
        chosen, every = make_launchers("auto", tmp_path)
        assert chosen.name == "local" and set(every) == {"local"}
    assert make_launchers("slurm", tmp_path)[0].name == "slurm"  # asked for: used, and it will say why


def job_dir(tmp_path: Path, script: str) -> Path:
    d = tmp_path / "job"
    d.mkdir(parents=True)
    entrypoint = jobdir.make_control_dir(d) / ENTRYPOINT_FILE  # where the launchers look
    entrypoint.write_text(f"#!/usr/bin/env bash\n{script}\n")
    entrypoint.chmod(0o700)
    return d


def wait_for(launcher, run_id: str, predicate, timeout_s: float = 30.0) -> LaunchState:
    deadline = time.monotonic() + timeout_s
    while True:
        state = launcher.state(run_id)
        if predicate(state):
            return state
        assert time.monotonic() < deadline, f"{run_id} still {state}"
        time.sleep(0.1)


@pytest.fixture
def slurm_launcher(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    return SlurmLauncher()


def test_slurm_runs_finds_and_cancels_jobs(slurm_launcher, tmp_path):
    d = job_dir(tmp_path, 'echo "hello from $SLURM_JOB_ID"; sleep 60')
    spec = LaunchSpec("hash-one", d, ranks=1, time_limit_s=600)
    run_id = slurm_launcher.submit(spec)
    assert run_id.isdigit()
    wait_for(slurm_launcher, run_id, lambda s: s is LaunchState.RUNNING)
    assert slurm_launcher.find("hash-one") == run_id
    assert slurm_launcher.find("hash-other") is None
    assert "hash-one" in slurm_launcher.queue_text()
    # One tenant's view: its own jobs' rows under squeue's header, nobody else's.
    assert "hash-one" in slurm_launcher.queue_text(["hash-one"])
    only_header = slurm_launcher.queue_text(["hash-other"]).splitlines()
    assert len(only_header) == 1 and "JOBID" in only_header[0], only_header
    assert slurm_launcher.cluster_info() == (0, 1)
    # RUNNING comes before the script starts: with --export naming variables, slurmd first loads
    # the account's login environment (`su - user -c env`, ~2 s here).
    log = jobdir.log_path(d, "slurm", run_id)
    deadline = time.monotonic() + 30
    while not (log.exists() and "hello" in log.read_text()):
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.1)

    slurm_launcher.cancel(run_id)
    assert wait_for(slurm_launcher, run_id, lambda s: s.ended) is LaunchState.CANCELLED
    slurm_launcher.cancel(run_id)  # ended already: not an error
    assert log.read_text().startswith(f"hello from {run_id}")
    # A job the controller never had (or purged) is GONE; sacct does not answer here.
    assert slurm_launcher.states([run_id, "999999"]) == {run_id: LaunchState.CANCELLED,
                                                         "999999": LaunchState.GONE}


def test_slurm_reports_how_a_job_ended(slurm_launcher, tmp_path):
    ok = slurm_launcher.submit(LaunchSpec("ok", job_dir(tmp_path / "a", "true"), 1, 60))
    bad = slurm_launcher.submit(LaunchSpec("bad", job_dir(tmp_path / "b", "exit 3"), 1, 60))
    assert wait_for(slurm_launcher, ok, lambda s: s.ended) is LaunchState.DONE
    assert wait_for(slurm_launcher, bad, lambda s: s.ended) is LaunchState.FAILED


def test_local_runs_survive_their_launcher(tmp_path):
    runs = tmp_path / "runs"
    first = LocalLauncher(runs)
    d = job_dir(tmp_path, 'trap "echo got TERM; exit 143" TERM; echo started; sleep 60 & wait')
    run_id = first.submit(LaunchSpec("hash-one", d, ranks=1, time_limit_s=60))
    assert first.state(run_id) is LaunchState.RUNNING

    # A new launcher (the trainer restarted) follows the same run from its record.
    second = LocalLauncher(runs)
    assert second.find("hash-one") == run_id and second.state(run_id) is LaunchState.RUNNING
    assert run_id in second.queue_text()
    assert run_id in second.queue_text(["hash-one"]) and run_id not in second.queue_text(["hash-other"])
    log = jobdir.log_path(d, "local", run_id)
    while "started" not in log.read_text():  # its TERM trap is set
        time.sleep(0.05)
    second.cancel(run_id)
    assert wait_for(second, run_id, lambda s: s.ended) is LaunchState.CANCELLED
    assert wait_for(first, run_id, lambda s: s.ended) is LaunchState.CANCELLED
    assert "got TERM" in log.read_text()
    assert second.find("hash-one") is None
    assert second.state("L0") is LaunchState.GONE


def test_local_exit_statuses(tmp_path):
    launcher = LocalLauncher(tmp_path / "runs")
    ok = launcher.submit(LaunchSpec("ok", job_dir(tmp_path / "a", "true"), 1, 60))
    bad = launcher.submit(LaunchSpec("bad", job_dir(tmp_path / "b", "exit 3"), 1, 60))
    termed = launcher.submit(LaunchSpec("t", job_dir(tmp_path / "c", "kill -TERM $$"), 1, 60))
    assert wait_for(launcher, ok, lambda s: s.ended) is LaunchState.DONE
    assert wait_for(launcher, bad, lambda s: s.ended) is LaunchState.FAILED
    assert wait_for(launcher, termed, lambda s: s.ended) is LaunchState.PREEMPTED
    for run_id in (ok, bad, termed):  # ended and reaped: no zombie left in /proc
        pid = json.loads((tmp_path / "runs" / f"{run_id}.json").read_text())["pid"]
        assert not Path(f"/proc/{pid}").exists() or _proc_state(pid) != "Z"


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
