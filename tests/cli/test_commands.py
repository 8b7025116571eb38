"""The commands against the real gateway and trainer (the stand-in training program, paced by its
params): exit codes and the messages users act on. What the CLI sent is read from what the trainer
made of it: the job directory, the ``datasets`` object store, the trainer's answers."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loopline.cli.client import SseMessage, parse_sse
from loopline.common.contracts.job_hash import job_hash as hash_job
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, DATASET_FILE, EVENTS_FILE, checkpoint_name
from loopline.common.contracts.train_params import JobConfig, canonical
from support.gateway_process import BASE_MODEL

ROWS = '{"input": "What is 2+2?", "output": "4"}\n{"input": "Capital of France?", "output": "Paris"}\n'
ROWS_SHA256 = hashlib.sha256(ROWS.encode()).hexdigest()


def _data(tmp_path: Path, rows: str = ROWS) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(rows)
    return path


def _submit(cli, tmp_path: Path, *args: str) -> str:
    """``loopline train --no-follow``: the job hash it printed."""
    result = cli("train", str(_data(tmp_path)), "--no-follow", *args)
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def _shown_checkpoint(step: int) -> str:
    return f"checkpoint at step {step}: {CHECKPOINTS_DIR}/{checkpoint_name(step)}"


def test_train_follow_completed(cli, trainer, tmp_path):
    result = cli("train", str(_data(tmp_path)), "--steps", "8", "--adapter", "lora", "--lr", "0.001",
                 "--param", "lora_config.r=16", "--param", "seed=7", "--param", "steps_per_checkpoint=4")
    assert result.exit_code == 0, result.output
    job_hash = result.stdout.strip().splitlines()[0]
    assert _shown_checkpoint(4) in result.output and _shown_checkpoint(8) in result.output
    assert f"completed {job_hash} at step 8/8" in result.output
    trainer.wait(job_hash, "COMPLETED")  # the row follows the event once the run has exited
    # What the trainer got: exactly the params given (llm_name filled in by the gateway) and the
    # file's bytes, stored once under their hash; the job is named by both.
    params = {"adapter_type": "lora", "max_steps": 8, "learning_rate": 0.001, "lora_config": {"r": 16},
              "seed": 7, "steps_per_checkpoint": 4, "llm_name": BASE_MODEL}
    job_dir = trainer.job_dir(job_hash)
    assert canonical(JobConfig.read(job_dir).params) == params
    assert (job_dir / DATASET_FILE).read_text() == ROWS
    assert trainer.dataset(ROWS_SHA256) == ROWS.encode()
    assert job_hash == hash_job(params, ROWS_SHA256)


def test_train_follow_failed(cli, trainer, tmp_path):
    error = "RuntimeError: CUDA out of memory (simulated)"
    result = cli("train", str(_data(tmp_path)), "--param", f"standin_fail={error}")
    assert result.exit_code == 1, result.output
    job_hash = result.stdout.strip().splitlines()[0]
    assert f"failed {job_hash}" in result.output
    assert error in result.output and trainer.wait(job_hash, "FAILED").error == error
    assert f"loopline logs {job_hash[:12]}" in result.output


def test_resubmit_is_the_same_job(cli, trainer, tmp_path):
    first = _submit(cli, tmp_path, "--steps", "3")
    stored = trainer.dataset_info(ROWS_SHA256)
    again = _submit(cli, tmp_path, "--steps", "3")
    assert first == again and len(first) == 64
    # One job, queued once, and its dataset not written again.
    trainer.wait(first, "COMPLETED")
    events = (trainer.job_dir(first) / EVENTS_FILE).read_text()
    assert events.count('"queued"') == 1
    assert trainer.dataset_info(ROWS_SHA256).nuid == stored.nuid


# Tier: restarts the gateway process and follows across it, ~12 s.
@pytest.mark.slow
def test_follow_survives_a_gateway_restart(cli, gateway, trainer, tmp_path):
    # 30 steps of 0.4 s, a checkpoint every 2. Once the CLI has shown the first checkpoints, the
    # gateway is restarted (stopped as a deploy stops it, then started on the same port). Measured:
    # the stop takes 5 s (uvicorn's grace for the open event stream), the start 2 s, so the old
    # process is gone about 6 s into the job's 12: the end can only reach the CLI through the new one.
    job_hash = _submit(cli, tmp_path, "--steps", "30", "--param", "steps_per_checkpoint=2",
                       "--param", "standin_step_s=0.4")

    def restart_mid_job() -> float:
        trainer.wait(job_hash, "TRAINING", min_step=3)
        return gateway.restart()

    with ThreadPoolExecutor(1) as pool:
        restarted = pool.submit(restart_mid_job)
        result = cli("follow", job_hash[:10])
        old_gateway_gone_at = restarted.result()
    assert result.exit_code == 0, result.output
    assert f"completed {job_hash} at step 30/30" in result.output
    assert gateway.restarts == 1 and trainer.wait(job_hash, "COMPLETED").finished_at > old_gateway_gone_at
    # The new stream replayed the job's history from its first event: each checkpoint shown once.
    for step in range(2, 31, 2):
        assert result.output.count(_shown_checkpoint(step)) == 1, result.output


def test_bad_jsonl_never_reaches_the_gateway(cli, refused_url, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(ROWS + '{"input": "x", "output": \n' + ROWS)
    result = cli("train", str(bad), url=refused_url)
    assert result.exit_code == 2, result.output
    assert "bad.jsonl:3:" in result.output and "not valid JSON" in result.output


def test_unknown_job_is_friendly(cli):
    for command in ("status", "follow", "cancel", "plot", "logs"):
        result = cli(command, "0badc0de")
        assert result.exit_code == 2, result.output
        assert "no such job: 0badc0de" in result.output and "loopline jobs" in result.output
        assert "Traceback" not in result.output


def test_ambiguous_prefix_asks_for_more(cli, tmp_path):
    # Jobs until two hashes share a first character (17 at most): that character names both.
    first_characters: set[str] = set()
    prefix = ""
    # Invariant: the jobs submitted so far have distinct first characters, `first_characters`.
    while not prefix:
        new = _submit(cli, tmp_path, "--steps", "1", "--param", f"seed={100 + len(first_characters)}")
        prefix = new[0] if new[0] in first_characters else ""
        first_characters.add(new[0])
    for command in ("status", "follow", "logs"):
        result = cli(command, prefix)
        assert result.exit_code == 2, result.output
        assert f"{prefix!r} names more than one job" in result.output and "loopline jobs" in result.output
        assert "Traceback" not in result.output


def test_connection_refused_says_make_up(refused_url):
    # Through the installed console script: the entry point itself is part of what is tested.
    exe = shutil.which("loopline", path=str(Path(sys.executable).parent))
    assert exe, "the loopline console script is not installed (pip install -e cli)"
    done = subprocess.run([exe, "--url", refused_url, "jobs"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert "is the gateway running? start it with `make up`" in done.stderr
    assert "Traceback" not in done.stderr


def test_inspection_commands(cli, trainer, tmp_path):
    job_hash = _submit(cli, tmp_path, "--steps", "5", "--param", "seed=1")
    info = trainer.wait(job_hash, "COMPLETED")
    jobs = cli("jobs")
    assert jobs.exit_code == 0 and job_hash[:12] in jobs.stdout, jobs.output
    status = cli("status", job_hash[:8], "--last", "3")
    assert status.exit_code == 0, status.output
    assert "COMPLETED" in status.stdout and BASE_MODEL in status.stdout and "last 3 losses" in status.stdout
    assert all(f"{point.loss:.4f}" in status.stdout for point in info.history[-3:])
    logs = cli("logs", job_hash, "--from-line", "2")
    assert logs.exit_code == 0, logs.output
    log = trainer.logs(job_hash).lines
    assert logs.stdout.splitlines() == [f"{entry.line_number} {entry.line}" for entry in log[2:]]
    assert "2 standin: step 2 of 5" in logs.stdout.splitlines()  # the training program's own lines

    # A job that stays queued (its stand-in "loads" for two minutes) is cancelled, restarted, deleted.
    waiting = _submit(cli, tmp_path, "--steps", "5", "--param", "standin_start_s=120")
    cancel = cli("cancel", waiting[:12])
    assert cancel.exit_code == 0 and f"cancelled {waiting}" in cancel.stdout and "CANCELLED" in cancel.stdout
    assert trainer.job(waiting).status.value == "CANCELLED"
    restart = cli("restart", job_hash)
    assert restart.exit_code == 2 and "not possible in the job's current state" in restart.output
    restart = cli("restart", waiting)
    assert restart.exit_code == 0 and f"restarted {waiting}" in restart.stdout, restart.output
    assert cli("delete", waiting, "--yes").exit_code == 0
    assert not trainer.job_dir(waiting).exists()
    assert "no such job" in cli("status", waiting).output


def test_sse_parsing():
    lines = [": keepalive", "", "id: 7", "event: progress", 'data: {"step": 1,', 'data:  "loss": 2.5}', "",
             '{"line": "a: b", "line_number": 0}', "event: completed", "data: {}"]
    assert list(parse_sse(lines)) == [SseMessage("progress", '{"step": 1,\n "loss": 2.5}', id="7"),
                                      SseMessage("message", '{"line": "a: b", "line_number": 0}'),
                                      SseMessage("completed", "{}")]
