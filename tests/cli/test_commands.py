"""The commands against a stand-in gateway over real HTTP: exit codes and the messages users act on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from loopline.cli.client import SseMessage, parse_sse

ROWS = '{"input": "What is 2+2?", "output": "4"}\n{"input": "Capital of France?", "output": "Paris"}\n'


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(ROWS)
    return path


def test_train_follow_completed(cli, standin, tmp_path):
    result = cli("train", str(_data(tmp_path)), "--steps", "8", "--adapter", "lora", "--lr", "0.001",
                 "--param", "lora_config.r=16", "--param", "seed=7")
    assert result.exit_code == 0, result.output
    job_hash = result.stdout.strip().splitlines()[0]
    assert job_hash in standin.jobs
    assert "checkpoint at step 4" in result.output
    assert f"completed {job_hash} at step 8/8" in result.output
    _, params = standin.uploads[-1]
    assert params == {"adapter_type": "lora", "max_steps": 8, "learning_rate": 0.001,
                      "lora_config": {"r": 16}, "seed": 7}


def test_train_follow_failed(cli, standin, tmp_path):
    result = cli("train", str(_data(tmp_path)), "--param", "scenario=fail")
    assert result.exit_code == 1, result.output
    job_hash = result.stdout.strip().splitlines()[0]
    assert f"failed {job_hash}" in result.output
    assert "CUDA out of memory (simulated)" in result.output
    assert f"loopline logs {job_hash[:12]}" in result.output


def test_resubmit_is_the_same_job(cli, standin, tmp_path):
    first = cli("train", str(_data(tmp_path)), "--no-follow", "--steps", "3")
    again = cli("train", str(_data(tmp_path)), "--no-follow", "--steps", "3")
    assert first.exit_code == again.exit_code == 0, first.output + again.output
    assert first.stdout == again.stdout and len(first.stdout.strip()) == 64
    assert standin.uploads[-1][0] == standin.uploads[-2][0]  # byte-identical archives


def test_follow_survives_a_cut_stream(cli, standin):
    job_hash = standin.add_job({"scenario": "cut", "max_steps": 6})
    result = cli("follow", job_hash[:10])
    assert result.exit_code == 0, result.output
    assert standin.event_connections[job_hash] == 2
    assert result.output.count("checkpoint at step 3") == 1  # the replayed history is not shown twice


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


def test_connection_refused_says_make_up(refused_url):
    # Through the installed console script: the entry point itself is part of what is tested.
    exe = shutil.which("loopline", path=str(Path(sys.executable).parent))
    assert exe, "the loopline console script is not installed (pip install -e cli)"
    done = subprocess.run([exe, "--url", refused_url, "jobs"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert "is the gateway running? start it with `make up`" in done.stderr
    assert "Traceback" not in done.stderr


def test_inspection_commands(cli, standin):
    job_hash = standin.add_job({"max_steps": 5, "llm_name": "tiny-llama"})
    jobs = cli("jobs")
    assert jobs.exit_code == 0 and job_hash[:12] in jobs.stdout, jobs.output
    status = cli("status", job_hash[:8], "--last", "3")
    assert status.exit_code == 0, status.output
    assert "COMPLETED" in status.stdout and "tiny-llama" in status.stdout and "last 3 losses" in status.stdout
    logs = cli("logs", job_hash, "--from-line", "2")
    assert logs.exit_code == 0, logs.output
    assert logs.stdout.splitlines()[0] == "2 step 3 loss 1.000" and len(logs.stdout.splitlines()) == 3
    cancel = cli("cancel", job_hash)
    assert cancel.exit_code == 0 and "cancelled" in cancel.stdout and "CANCELLED" in cancel.stdout
    restart = cli("restart", job_hash)
    assert restart.exit_code == 2 and "not possible in the job's current state" in restart.output
    assert cli("delete", job_hash, "--yes").exit_code == 0


def test_sse_parsing():
    lines = [": keepalive", "", "id: 7", "event: progress", 'data: {"step": 1,', 'data:  "loss": 2.5}', "",
             '{"line": "a: b", "line_number": 0}', "event: completed", "data: {}"]
    assert list(parse_sse(lines)) == [SseMessage("progress", '{"step": 1,\n "loss": 2.5}'),
                                      SseMessage("message", '{"line": "a: b", "line_number": 0}'),
                                      SseMessage("completed", "{}")]
