"""What the trainer reads: atomic, rotated checkpoints; status.json and events.jsonl; failures."""

from __future__ import annotations

import subprocess
import threading

from safetensors import safe_open

from loopline.common.contracts import adapter_format
from loopline.common.contracts.job_layout import (
    CHECKPOINTS_DIR,
    TRAINING_STATE_FILE,
    checkpoint_name,
    checkpoint_step,
    checkpoint_temp_prefix,
)
from loopline.ml.adapters import read_adapter_config

CHECKPOINT_FILES = sorted([*adapter_format.FILES, TRAINING_STATE_FILE])
STATUS_FIELDS = {"status", "step", "max_steps", "epoch", "loss", "history", "started_at", "updated_at",
                 "error", "accumulated_train_seconds"}


def watch_checkpoints(root, stop: threading.Event, seen: set, partial: list) -> None:
    """A reader like the checkpoint-watcher: every checkpoint folder it sees must already be whole."""
    while not stop.is_set():
        for path in root.iterdir() if root.is_dir() else ():
            if checkpoint_step(path.name) is None:
                continue
            try:
                files = sorted(p.name for p in path.iterdir())
            except FileNotFoundError:  # rotated away between glob and listing: fine
                continue
            seen.add(path.name)
            if files != CHECKPOINT_FILES and path.exists():
                partial.append((path.name, files))
        stop.wait(0.002)


def test_checkpoints_status_and_events(jobs):
    job = jobs.write("outputs", {"max_steps": 7, "steps_per_checkpoint": 2, "max_checkpoints_to_keep": 2,
                                 "batch_size": 2, "gradient_accumulation_steps": 1, "some_future_key": 1,
                                 "tokenformer_config": {"num_tokens": 4, "target_modules": ["v_proj"]}})
    leftover = job / CHECKPOINTS_DIR / f"{checkpoint_temp_prefix(4)}killed"  # from a run killed mid-write
    leftover.mkdir(parents=True)
    (leftover / adapter_format.CONFIG_FILE).write_text("{")

    stop, seen, partial = threading.Event(), set(), []
    reader = threading.Thread(target=watch_checkpoints, args=(job / CHECKPOINTS_DIR, stop, seen, partial))
    reader.start()
    try:
        run = jobs.run(job)
    finally:
        stop.set()
        reader.join()
    assert run.returncode == 0, run.stderr[-3000:]
    assert partial == []
    assert seen <= {checkpoint_name(s) for s in (2, 4, 6, 7)} and checkpoint_name(7) in seen

    # Rotation keeps the newest two; no temp or half-deleted folder is left.
    kept = sorted(p.name for p in (job / CHECKPOINTS_DIR).iterdir())
    assert kept == [checkpoint_name(6), checkpoint_name(7)]
    final = job / CHECKPOINTS_DIR / checkpoint_name(7)
    assert sorted(p.name for p in final.iterdir()) == CHECKPOINT_FILES
    config = read_adapter_config(final)
    assert config["adapter_type"] == "tokenformer" and config["num_tokens"] == 4
    assert config["target_modules"] == ["v_proj"] and config["step"] == 7
    with safe_open(final / adapter_format.WEIGHTS_FILE, "pt") as f:
        names = sorted(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    assert names == [f"model.layers.{i}.self_attn.v_proj.tokenformer_{kv}" for i in (0, 1) for kv in "kv"]
    assert shapes["model.layers.0.self_attn.v_proj.tokenformer_k"] == (4, 64)  # [n, d_in]
    assert shapes["model.layers.0.self_attn.v_proj.tokenformer_v"] == (4, 64)  # [n, d_out]: 1 kv head x 64

    status = jobs.status(job)
    assert status.keys() >= STATUS_FIELDS
    assert status["status"] == "COMPLETED" and status["step"] == status["max_steps"] == 7
    assert status["error"] is None and status["updated_at"] >= status["started_at"]
    assert [p["step"] for p in status["history"]] == list(range(1, 8))
    assert all({"step", "loss", "epoch", "time"} == p.keys() for p in status["history"])
    assert status["epoch"] == 14 / 3  # 7 steps x 2 examples over 3 examples

    events = jobs.events(job)
    assert all("kind" in e and "time" in e for e in events)
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "completed"
    assert kinds.count("progress") == 7 and kinds.count("checkpoint") == 4
    progress = [e for e in events if e["kind"] == "progress"]
    assert [e["step"] for e in progress] == list(range(1, 8))
    progress_fields = {"step", "max_steps", "loss", "learning_rate", "tokens_per_s", "epoch", "time"}
    assert progress_fields <= progress[0].keys()
    first_lr, last_lr = progress[0]["learning_rate"], progress[-1]["learning_rate"]
    assert first_lr == 3e-3 and 0 < last_lr < first_lr  # linear decay, default rate
    checkpoints = [e for e in events if e["kind"] == "checkpoint"]
    assert [(e["step"], e["path"]) for e in checkpoints] == [
        (s, f"{CHECKPOINTS_DIR}/{checkpoint_name(s)}") for s in (2, 4, 6, 7)]
    assert all(isinstance(e["created_at"], float) for e in checkpoints)


def _assert_failed(jobs, job, match: str) -> None:
    run = jobs.run(job)
    assert run.returncode == 1, run.stderr[-3000:]
    status = jobs.status(job)
    assert status["status"] == "FAILED" and match in status["error"]
    failed = [e for e in jobs.events(job) if e["kind"] == "failed"]
    assert len(failed) == 1 and match in failed[0]["error"]
    assert not (job / CHECKPOINTS_DIR).exists() or not any((job / CHECKPOINTS_DIR).iterdir())


def test_empty_dataset_fails(jobs):
    _assert_failed(jobs, jobs.write("empty", {"max_steps": 2}, pairs=[]), "holds no examples")


def test_missing_model_and_bad_params_fail(jobs, tmp_path):
    _assert_failed(jobs, jobs.write("nomodel", {"max_steps": 2}, model=str(tmp_path / "no-such-model")),
                   "no-such-model")
    job = jobs.write("badparams", {"max_steps": 0})
    _assert_failed(jobs, job, "max_steps")


def test_missing_job_dir_is_an_error(jobs, tmp_path):
    run = subprocess.run(jobs.command(tmp_path / "nope"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "does not exist" in run.stderr
