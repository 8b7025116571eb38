"""``loopline plot`` writes a real PNG, from the gateway's history and from a local status.json."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image

from loopline.cli.client import Gateway
from loopline.cli.main import _learning_rates
from loopline.cli.plot import JOB_CONFIG_FILE, STATUS_FILE, load_status_file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5_000  # axes, a line and labels; an empty canvas compresses to far less
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (540, 960)  # 8 x 4.5 inches at 120 dpi
    assert pixels[..., :3].std() > 0.05  # not one flat colour


def test_plot_from_the_gateway(cli, gateway, trainer, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "What is 2+2?", "output": "4"}\n')
    submitted = cli("train", str(data), "--steps", "30", "--no-follow")
    assert submitted.exit_code == 0, submitted.output
    job_hash = submitted.stdout.strip()
    trainer.wait(job_hash, "COMPLETED")
    out = tmp_path / "loss.png"
    result = cli("plot", job_hash[:12], "--out", str(out))
    assert result.exit_code == 0, result.output
    _check_png(out)
    gateway_client = Gateway(gateway.url)
    try:
        lrs = _learning_rates(gateway_client, job_hash)
    finally:
        gateway_client.close()
    # One point per step, as the job's progress events (the training program's own) carry them.
    progress = [e for e in trainer.events(job_hash) if e.kind == "progress"]
    assert len(lrs) == 30 and lrs == [(e.step, e.learning_rate) for e in progress]


def test_plot_from_file(cli, refused_url, tmp_path):
    job_dir = tmp_path / ("ab" * 32)
    job_dir.mkdir()
    history = [{"step": s, "loss": 4.0 / s, "epoch": 0.0, "time": float(s)} for s in range(1, 11)]
    (job_dir / STATUS_FILE).write_text(json.dumps({"status": "COMPLETED", "history": history}))
    (job_dir / "config.yaml").write_text("llm_name: tiny-llama\nmax_steps: 10\n")
    out = tmp_path / "offline.png"
    # No gateway needed: the URL refuses connections and the command must not try it.
    result = cli("plot", "--from-file", str(job_dir / STATUS_FILE), "--out", str(out), url=refused_url)
    assert result.exit_code == 0, result.output
    _check_png(out)


def test_a_job_directory_names_its_model(tmp_path):
    """Ours holds config.json with the served model in its params (ScalarLM's: config.yaml)."""
    (tmp_path / STATUS_FILE).write_text(json.dumps({"status": "QUEUED", "history": []}))
    (tmp_path / JOB_CONFIG_FILE).write_text(json.dumps(
        {"job_hash": "ab" * 32, "model_path": "/models/tiny", "params": {"llm_name": "tiny"}}))
    assert load_status_file(tmp_path)[2] == "tiny"


def test_plot_without_history_says_why(cli, refused_url, tmp_path):
    (tmp_path / STATUS_FILE).write_text(json.dumps({"status": "QUEUED", "history": []}))
    result = cli("plot", "--from-file", str(tmp_path), "--out", str(tmp_path / "x.png"), url=refused_url)
    assert result.exit_code == 2 and "no loss history yet" in result.output
