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

from loopline.common.contracts import subjects
from loopline.common.contracts.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loopline.common.contracts.job_layout import STATUS_FILE
from loopline.common.contracts.job_schemas import CheckpointAnnounce
from loopline.common.local import launcher

MODEL = "tiny"


def job_hash(name: str) -> str:
    """A job hash as the trainer names jobs (64 hex digits), told apart here by its name."""
    return hashlib.sha256(name.encode()).hexdigest()


JOB_A, JOB_C, JOB_L, JOB_R, JOB_S, JOB_X, JOB_Y = (job_hash(name) for name in "aclrsxy")


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
    jobs.job(JOB_A)
    tmp = jobs.staged(JOB_A, 2)
    await asyncio.sleep(0.5)
    assert heard.announced == [], "a folder still being written was announced"

    final = jobs.publish(tmp)
    _, subject, announce = (await heard.until(lambda: heard.announced))[0]
    assert subject == subjects.checkpoint_subject(MODEL, JOB_A)
    assert (announce.job_hash, announce.step, announce.adapter_type, announce.base_model) == \
        (JOB_A, 2, "tokenformer", MODEL)
    assert announce.object_name == f"{JOB_A}/2"
    assert announce.adapter_config["num_tokens"] == 8 and announce.adapter_config["step"] == 2
    assert announce.created_at == pytest.approx(final.stat().st_mtime)

    obj = await (await heard.js.object_store(subjects.ADAPTERS_BUCKET)).get(f"{JOB_A}/2")
    assert len(obj.data) == announce.size
    assert hashlib.sha256(obj.data).hexdigest() == announce.sha256
    files = members(obj.data)
    assert list(files) == [CONFIG_FILE, WEIGHTS_FILE]  # no training_state.pt
    assert files[CONFIG_FILE] == (final / CONFIG_FILE).read_bytes()
    assert files[WEIGHTS_FILE] == (final / WEIGHTS_FILE).read_bytes()
    tensors = load_tensors(files[WEIGHTS_FILE])
    assert tensors.keys() == adapter[1].keys()
    assert all((tensors[k] == v).all() for k, v in adapter[1].items())

    # More events in the job (another file, a folder being written) announce nothing again.
    (final.parent.parent / STATUS_FILE).write_text("{}")
    jobs.staged(JOB_A, 4)
    await asyncio.sleep(0.5)
    assert heard.steps(JOB_A) == [2]
    status = await heard.status()
    assert status["announced"] == 1 and status["last_announced"]["step"] == 2


CORRUPTIONS = {
    "truncated": (WEIGHTS_FILE, lambda b: b[:-100], "truncated"),
    "no header": (WEIGHTS_FILE, lambda b: b"\xff" * 8 + b[8:], "does not fit"),
    "header not JSON": (WEIGHTS_FILE,
                        lambda b: b[:8] + b"[" + b[9:], "not JSON"),
    "extra bytes": (WEIGHTS_FILE, lambda b: b + b"\0" * 16, "trailing bytes"),
    "unknown adapter_type": (CONFIG_FILE,
                             lambda b: json.dumps({**json.loads(b), "adapter_type": "magic"}).encode(),
                             "unknown adapter_type"),
    "config not JSON": (CONFIG_FILE, lambda b: b[:-5], "not JSON"),
}


async def test_a_corrupt_checkpoint_is_rejected_and_never_announced(start_watcher, jobs, heard):
    await start_watcher(rescan_interval_s=60)
    jobs.job(JOB_C)
    for step, (kind, (name, corrupt, reason)) in enumerate(CORRUPTIONS.items(), start=1):
        tmp = jobs.staged(JOB_C, step)
        (tmp / name).write_bytes(corrupt((tmp / name).read_bytes()))
        jobs.publish(tmp)
        event = await heard.until(lambda step=step: [e for e in heard.rejected if e.step == step])
        assert event[0].job_hash == JOB_C and reason in event[0].reason, (kind, event[0].reason)
    missing = jobs.staged(JOB_C, 20)
    (missing / WEIGHTS_FILE).unlink()
    jobs.publish(missing)
    await heard.until(lambda: [e for e in heard.rejected if e.step == 20 and "missing" in e.reason])

    obs = await heard.js.object_store(subjects.ADAPTERS_BUCKET)
    with pytest.raises(NotFoundError):
        await obs.get_info(f"{JOB_C}/1")
    assert heard.announced == []

    # The next good checkpoint is served; the rejected ones stay rejected (reported once).
    jobs.checkpoint(JOB_C, 30)
    await heard.until(lambda: heard.announced)
    assert heard.steps(JOB_C) == [30]
    assert len(heard.rejected) == len(CORRUPTIONS) + 1


async def test_a_restart_neither_repeats_nor_misses_a_checkpoint(start_watcher, jobs, heard):
    jobs.job(JOB_R)
    first = await start_watcher()
    jobs.checkpoint(JOB_R, 1)
    await heard.until(lambda: heard.steps(JOB_R) == [1])
    launcher.stop(first)

    # Written while it was down: two steps of job R (only the newer one is worth serving), a new
    # job, and a corrupt checkpoint.
    jobs.checkpoint(JOB_R, 2)
    jobs.checkpoint(JOB_R, 3)
    jobs.job(JOB_S)
    jobs.checkpoint(JOB_S, 5)
    bad = jobs.staged(JOB_S, 6)
    (bad / WEIGHTS_FILE).write_bytes(b"\0" * 4)
    jobs.publish(bad)

    second = await start_watcher()
    await heard.rescanned(2)
    assert heard.steps(JOB_R) == [1, 3]
    assert heard.steps(JOB_S) == [5]  # 6 is corrupt: 5 is the newest servable one
    assert [(e.job_hash, e.step) for e in heard.rejected] == [(JOB_S, 6)]
    launcher.stop(second)

    # A restart with nothing new publishes nothing, even when the cursor was lost after an
    # announcement (a crash between the two): the stream's last message says it was announced.
    kv = await heard.js.key_value(subjects.CHECKPOINT_CURSOR_BUCKET)
    await kv.delete(JOB_R)
    seq = (await heard.js.stream_info(subjects.CHECKPOINTS_STREAM)).state.last_seq
    await start_watcher()
    await heard.rescanned(2)
    assert heard.steps(JOB_R) == [1, 3] and heard.steps(JOB_S) == [5]
    assert len(heard.rejected) == 1
    assert (await heard.js.stream_info(subjects.CHECKPOINTS_STREAM)).state.last_seq == seq


async def test_the_stream_keeps_each_jobs_newest_step(start_watcher, jobs, heard):
    await start_watcher()
    for job in (JOB_X, JOB_Y):
        jobs.job(job)
    for step in (1, 2, 3, 4):
        for job in (JOB_X, JOB_Y):
            jobs.checkpoint(job, step, keep=2)  # rotation removes old folders meanwhile
    await heard.until(lambda: 4 in heard.steps(JOB_X) and 4 in heard.steps(JOB_Y))
    await heard.rescanned(1)
    for job in (JOB_X, JOB_Y):
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
    jobs.job(JOB_L)
    latencies, in_watcher = [], []
    for step in range(1, 11):
        tmp = jobs.staged(JOB_L, step)
        renamed = time.time()
        jobs.publish(tmp)
        arrived, _, announce = (await heard.until(
            lambda step=step: [a for a in heard.announced if a[2].step == step]))[0]
        latencies.append(arrived - renamed)
        in_watcher.append(announce.announced_at - renamed)
    p50 = statistics.median(latencies)
    print(f"\ncheckpoint renamed -> announcement received: p50 {p50 * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms (published by the watcher after p50 "
          f"{statistics.median(in_watcher) * 1000:.1f} ms; {len(latencies)} checkpoints, "
          f"{announce.size} bytes each)")
    assert p50 < 1.0
