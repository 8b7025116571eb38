"""The checkpoint-watcher as a real process over a real nats-server: finished checkpoints are
announced once, with their adapter in the object store; folders being written are ignored; corrupt
ones are rejected and never announced; restarts neither repeat nor miss anything; and a new
checkpoint is noticed fast."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import statistics
import tarfile
import time

import pytest
from nats.js.errors import NotFoundError

from loopline.common import launcher, subjects
from loopline.common.job_schemas import CheckpointAnnounce

MODEL = "tiny"


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        infos = tar.getmembers()
        assert all(i.mtime == 0 and i.uid == 0 and i.gid == 0 for i in infos)
        return {i.name: tar.extractfile(i).read() for i in infos}


async def test_a_renamed_checkpoint_is_announced_once_and_its_adapter_round_trips(
        start_watcher, jobs, heard, adapter):
    from safetensors.torch import load as load_tensors

    # Inotify must do the noticing here: the safety-net rescan is a minute away.
    await start_watcher(rescan_interval_s=60)
    jobs.job("job-a")
    tmp = jobs.staged("job-a", 2)
    await asyncio.sleep(0.5)
    assert heard.announced == [], "a folder still being written was announced"

    final = jobs.publish(tmp)
    _, subject, announce = (await heard.until(lambda: heard.announced))[0]
    assert subject == subjects.checkpoint_subject(MODEL, "job-a")
    assert (announce.job_hash, announce.step, announce.adapter_type, announce.base_model) == \
        ("job-a", 2, "tokenformer", MODEL)
    assert announce.object_name == "job-a/2"
    assert announce.adapter_config["num_tokens"] == 8 and announce.adapter_config["step"] == 2
    assert announce.created_at == pytest.approx(final.stat().st_mtime)

    obj = await (await heard.js.object_store(subjects.ADAPTERS_BUCKET)).get("job-a/2")
    assert len(obj.data) == announce.size
    assert hashlib.sha256(obj.data).hexdigest() == announce.sha256
    files = members(obj.data)
    assert list(files) == ["adapter_config.json", "adapter_model.safetensors"]  # no training_state.pt
    assert files["adapter_config.json"] == (final / "adapter_config.json").read_bytes()
    assert files["adapter_model.safetensors"] == (final / "adapter_model.safetensors").read_bytes()
    tensors = load_tensors(files["adapter_model.safetensors"])
    assert tensors.keys() == adapter[1].keys()
    assert all((tensors[k] == v).all() for k, v in adapter[1].items())

    # More events in the job (another file, a folder being written) announce nothing again.
    (final.parent.parent / "status.json").write_text("{}")
    jobs.staged("job-a", 4)
    await asyncio.sleep(0.5)
    assert heard.steps("job-a") == [2]
    status = await heard.status()
    assert status["announced"] == 1 and status["last_announced"]["step"] == 2


CORRUPTIONS = {
    "truncated": ("adapter_model.safetensors", lambda b: b[:-100], "truncated"),
    "no header": ("adapter_model.safetensors", lambda b: b"\xff" * 8 + b[8:], "does not fit"),
    "header not JSON": ("adapter_model.safetensors",
                        lambda b: b[:8] + b"[" + b[9:], "not JSON"),
    "extra bytes": ("adapter_model.safetensors", lambda b: b + b"\0" * 16, "trailing bytes"),
    "unknown adapter_type": ("adapter_config.json",
                             lambda b: json.dumps({**json.loads(b), "adapter_type": "magic"}).encode(),
                             "unknown adapter_type"),
    "config not JSON": ("adapter_config.json", lambda b: b[:-5], "not JSON"),
}


async def test_a_corrupt_checkpoint_is_rejected_and_never_announced(start_watcher, jobs, heard):
    await start_watcher(rescan_interval_s=60)
    jobs.job("job-c")
    for step, (kind, (name, corrupt, reason)) in enumerate(CORRUPTIONS.items(), start=1):
        tmp = jobs.staged("job-c", step)
        (tmp / name).write_bytes(corrupt((tmp / name).read_bytes()))
        jobs.publish(tmp)
        event = await heard.until(lambda: [e for e in heard.rejected if e.step == step])
        assert event[0].job_hash == "job-c" and reason in event[0].reason, (kind, event[0].reason)
    missing = jobs.staged("job-c", 20)
    (missing / "adapter_model.safetensors").unlink()
    jobs.publish(missing)
    await heard.until(lambda: [e for e in heard.rejected if e.step == 20 and "missing" in e.reason])

    obs = await heard.js.object_store(subjects.ADAPTERS_BUCKET)
    with pytest.raises(NotFoundError):
        await obs.get_info("job-c/1")
    assert heard.announced == []

    # The next good checkpoint is served; the rejected ones stay rejected (reported once).
    jobs.checkpoint("job-c", 30)
    await heard.until(lambda: heard.announced)
    assert heard.steps("job-c") == [30]
    assert len(heard.rejected) == len(CORRUPTIONS) + 1


async def test_a_restart_neither_repeats_nor_misses_a_checkpoint(start_watcher, jobs, heard):
    jobs.job("job-r")
    first = await start_watcher()
    jobs.checkpoint("job-r", 1)
    await heard.until(lambda: heard.steps("job-r") == [1])
    launcher.stop(first)

    # Written while it was down: two steps of job-r (only the newer one is worth serving), a new
    # job, and a corrupt checkpoint.
    jobs.checkpoint("job-r", 2)
    jobs.checkpoint("job-r", 3)
    jobs.job("job-s")
    jobs.checkpoint("job-s", 5)
    bad = jobs.staged("job-s", 6)
    (bad / "adapter_model.safetensors").write_bytes(b"\0" * 4)
    jobs.publish(bad)

    second = await start_watcher()
    await heard.rescanned(2)
    assert heard.steps("job-r") == [1, 3]
    assert heard.steps("job-s") == [5]  # 6 is corrupt: 5 is the newest servable one
    assert [(e.job_hash, e.step) for e in heard.rejected] == [("job-s", 6)]
    launcher.stop(second)

    # A restart with nothing new publishes nothing, even when the cursor was lost after an
    # announcement (a crash between the two): the stream's last message says it was announced.
    kv = await heard.js.key_value(subjects.CHECKPOINT_CURSOR_BUCKET)
    await kv.delete("job-r")
    seq = (await heard.js.stream_info(subjects.CHECKPOINTS_STREAM)).state.last_seq
    await start_watcher()
    await heard.rescanned(2)
    assert heard.steps("job-r") == [1, 3] and heard.steps("job-s") == [5]
    assert len(heard.rejected) == 1
    assert (await heard.js.stream_info(subjects.CHECKPOINTS_STREAM)).state.last_seq == seq


async def test_the_stream_keeps_each_jobs_newest_step(start_watcher, jobs, heard):
    await start_watcher()
    for job in ("job-x", "job-y"):
        jobs.job(job)
    for step in (1, 2, 3, 4):
        for job in ("job-x", "job-y"):
            jobs.checkpoint(job, step, keep=2)  # rotation removes old folders meanwhile
    await heard.until(lambda: 4 in heard.steps("job-x") and 4 in heard.steps("job-y"))
    await heard.rescanned(1)
    for job in ("job-x", "job-y"):
        steps = heard.steps(job)
        assert steps == sorted(set(steps)), f"{job} announced out of order or twice: {steps}"
        subject = subjects.checkpoint_subject(MODEL, job)
        msg = await heard.js.get_last_msg(subjects.CHECKPOINTS_STREAM, subject)
        last = CheckpointAnnounce.model_validate_json(msg.data)
        assert last.step == 4
        info = await (await heard.js.object_store(subjects.ADAPTERS_BUCKET)).get_info(f"{job}/4")
        assert info.size == last.size


async def test_a_new_checkpoint_is_noticed_fast(start_watcher, jobs, heard):
    await start_watcher(rescan_interval_s=60)  # inotify only: the rescan cannot help here
    jobs.job("job-l")
    latencies, in_watcher = [], []
    for step in range(1, 11):
        tmp = jobs.staged("job-l", step)
        renamed = time.time()
        jobs.publish(tmp)
        arrived, _, announce = (await heard.until(
            lambda: [a for a in heard.announced if a[2].step == step]))[0]
        latencies.append(arrived - renamed)
        in_watcher.append(announce.announced_at - renamed)
    p50 = statistics.median(latencies)
    print(f"\ncheckpoint renamed -> announcement received: p50 {p50 * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms (published by the watcher after p50 "
          f"{statistics.median(in_watcher) * 1000:.1f} ms; {len(latencies)} checkpoints, "
          f"{announce.size} bytes each)")
    assert p50 < 1.0
