"""``loopline tinker``: the tables from a real gateway's Tinker routes, a run's and a worker's events
to their end, and a cookbook metrics.jsonl plotted. The records are written through the product's
own TinkerStore and the events published as a session worker publishes them
(support/tinker_records.py); no trainer is needed, and none runs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import matplotlib.image
import pytest

from loopline.common.contracts.tinker_schemas import SessionEvent
from loopline.common.local import launcher
from support import tinker_records as records
from support.gateway_process import start_gateway
from support.session_events import session_events
from support.tinker_records import TinkerBus


@pytest.fixture(scope="module")
def gateway(lone_gateway):
    return lone_gateway


@pytest.fixture(scope="module")
def tinker(nats_proc, gateway) -> TinkerBus:
    return TinkerBus(nats_proc.info["url"], "cli-tinker-test")


def test_sessions_runs_and_checkpoints(cli, tinker):
    s, w = records.session(user_metadata={"owner": "ada"}), records.worker()
    older, newer = records.model(s, w, 0, created_at=time.time() - 60), records.model(s, w, 1)
    state = records.checkpoint(older, "weights", "state-1", size_bytes=3 * 1024 * 1024)
    sampler = records.checkpoint(older, "sampler_weights", "s1", step=4)
    tinker.put(s, w, older, newer, state, sampler)

    runs = cli("tinker", "runs")
    assert runs.exit_code == 0, runs.output
    lines = runs.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}  # one line a run: ids are never folded
    assert lines[0].split()[:3] == ["run", "base", "model"]
    assert list(rows)[:2] == [newer.model_id, older.model_id]  # newest first
    assert rows[older.model_id].split()[1:3] == [records.BASE, "8"]
    assert "sampler_weights/s1" in rows[older.model_id] and "weights/state-1" in rows[older.model_id]

    first = cli("tinker", "runs", "--limit", "1")
    assert first.exit_code == 0 and newer.model_id in first.stdout and older.model_id not in first.stdout
    assert "see more with --offset 1" in first.stderr

    checkpoints = cli("tinker", "checkpoints", older.model_id)
    assert checkpoints.exit_code == 0, checkpoints.output
    assert {line.split()[0]: line.split()[-1] for line in checkpoints.stdout.splitlines()[1:]} == {
        "weights/state-1": state.tinker_path, "sampler_weights/s1": sampler.tinker_path}
    assert "3.0 MiB" in checkpoints.stdout

    sessions = cli("tinker", "sessions")
    assert sessions.exit_code == 0, sessions.output
    row = next(line for line in sessions.stdout.splitlines() if line.startswith(s.session_id)).split()
    assert row[1] == "2" and set(row[2:4]) == {older.model_id, newer.model_id} and row[4] == "owner=ada"


def test_an_unknown_run_says_where_to_look(cli):
    result = cli("tinker", "checkpoints", f"{'e' * 32}:train:0")
    assert result.exit_code == 2
    assert "no such training run" in result.stderr and "loopline tinker runs" in result.stderr


def test_follow_a_run_to_its_end_and_a_worker_to_its_failure(cli, tinker):
    s, w = records.session(), records.worker()
    a, b = records.model(s, w, 0), records.model(s, w, 1)
    tinker.put(s, w, a, b)
    saved = f"tinker://{a.model_id}/sampler_weights/s2"

    def event(kind: str, of=None, **fields) -> SessionEvent:
        return SessionEvent(worker_id=w.worker_id, kind=kind, model_id=of.model_id if of else None, **fields)

    tinker.publish([event("created", a, base_model=records.BASE),
                    event("step", a, step=1, loss=2.5, staleness={1: 8, 0: 24}, unstamped=2),
                    event("step", b, step=1, loss=9.0)])
    # The rest comes while the command follows: published from beside it.
    live = [event("saved", a, step=1, path=saved), event("released", a, detail="idle for 600 s")]
    threading.Thread(target=lambda: (time.sleep(1.0), tinker.publish(live)), daemon=True).start()
    run = cli("tinker", "follow", a.model_id)
    assert run.exit_code == 0, run.output
    lines = run.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["created", "step", "saved", "released"]
    assert "loss 2.5000" in lines[1] and "loss 9.0000" not in run.stdout  # b's step is b's
    assert "samples 0 behind: 24, 1 behind: 8, other weights: 2" in lines[1]
    assert saved in lines[2] and "idle for 600 s" in lines[3]

    tinker.publish([event("failed", detail="its Slurm job ended FAILED")])
    worker = cli("tinker", "follow", "--worker", w.worker_id)
    assert worker.exit_code == 1, worker.output  # its history, ending with its failure
    assert worker.stdout.splitlines()[-1].split()[1:4] == ["failed", "worker", w.worker_id]
    assert "loss 9.0000" in worker.stdout and "ended FAILED" in worker.stdout


def test_a_keyed_gateway_takes_the_key_on_both_route_families(cli, nats_proc, tinker, tmp_path):
    # The Tinker tables read /api/v1 (X-API-Key), the event streams /v1 (Authorization: Bearer).
    keyed = start_gateway(nats_proc.info["url"], tmp_path, LOOPLINE_API_KEYS="tml-test-key")
    try:
        w = records.worker(state="released")
        tinker.put(w)
        refused = cli("tinker", "runs", url=keyed.url)
        assert refused.exit_code == 2 and "--api-key or LOOPLINE_API_KEY" in refused.stderr
        assert cli("--api-key", "tml-test-key", "tinker", "runs", url=keyed.url).exit_code == 0
        follow = cli("--api-key", "tml-test-key", "tinker", "follow", "--worker", w.worker_id, url=keyed.url)
        assert follow.exit_code == 0 and "it is over" in follow.stdout, follow.output
    finally:
        launcher.stop(keyed.proc)


def test_follow_refuses_a_run_and_a_worker_at_once(cli, refused_url):
    result = cli("tinker", "follow", "r", "--worker", "w", url=refused_url)
    assert result.exit_code == 2 and "not both" in result.stderr


def _metrics(path: Path, rows: list[dict]) -> Path:
    # The cookbook's JsonLogger writes {"step": n, **metrics}, one row an iteration; a run still
    # writing may leave a half-written last line.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "env/all/rew')
    return path


def test_plot_a_cookbook_runs_metrics(cli, refused_url, tmp_path):
    rows = [{"step": n, "env/all/reward/total": -0.1 + 0.02 * n, "train_mean_nll": 3.0 / (n + 1),
             "optim/lr": 3e-4, "progress/done_frac": n / 30, "note": "text"} for n in range(30)]
    metrics = _metrics(tmp_path / "metrics.jsonl", rows)
    out = tmp_path / "curves.png"
    # No gateway needed: the URL refuses connections and the command must not try it.
    result = cli("tinker", "plot", str(tmp_path), "--out", str(out), url=refused_url)
    assert result.exit_code == 0, result.output
    assert "skipped 1 line" in result.stderr
    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (624, 960)  # two panels (reward, loss): 8 x 5.2 inches at 120 dpi
    assert pixels[..., :3].std() > 0.05
    one = cli("tinker", "plot", str(metrics), "-k", "optim/lr", "--out", str(tmp_path / "lr.png"),
              url=refused_url)
    assert one.exit_code == 0 and matplotlib.image.imread(tmp_path / "lr.png").shape[:2] == (540, 960)


def test_plot_names_the_keys_a_file_has(cli, refused_url, tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl", [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}])
    result = cli("tinker", "plot", str(metrics), "--key", "los", url=refused_url)
    assert result.exit_code == 2 and "its metrics: loss" in result.stderr and "--key" in result.stderr
    nothing = cli("tinker", "plot", str(tmp_path / "absent.jsonl"), url=refused_url)
    assert nothing.exit_code == 2 and "cannot read" in nothing.stderr and "log_path" in nothing.stderr


def test_metrics_sends_a_cookbook_runs_metrics_to_its_run(cli, nats_proc, tinker, tmp_path):
    s, w = records.session(), records.worker()
    run = records.model(s, w, 0)
    tinker.put(s, w, run)
    rows = [{"step": n, "env/all/reward/total": 0.25 * n, "train_mean_nll": 2.0 - n, "optim/lr": 3e-4}
            for n in range(3)]
    metrics = _metrics(tmp_path / "metrics.jsonl", rows)
    keys = ("-k", "env/all/reward/total", "-k", "optim/lr")
    result = cli("tinker", "metrics", run.model_id, str(metrics), *keys)
    assert result.exit_code == 0, result.output
    assert "posted 3 step(s)" in result.stdout
    assert "step 2: env/all/reward/total 0.5, optim/lr 0.0003" in result.stdout
    posted = [e for e in session_events(nats_proc.info["url"], run.model_id) if e.kind == "metrics"]
    assert [(e.step, e.metrics) for e in posted] == [
        (n, {"env/all/reward/total": 0.25 * n, "optim/lr": 3e-4}) for n in range(3)]
    unknown = cli("tinker", "metrics", f"{'e' * 32}:train:0", str(metrics))
    assert unknown.exit_code == 2 and "loopline tinker runs" in unknown.stderr
