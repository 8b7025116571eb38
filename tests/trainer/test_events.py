"""events.jsonl -> EVENTS: each complete line once, in order, whatever the trainer crashed between."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, EVENTS_FILE, checkpoint_name
from loopline.common.contracts.job_schemas import JobStatus
from loopline.common.contracts.train_params import TrainParams
from loopline.common.db.engine import migrate, open_database
from loopline.trainer import jobdir
from loopline.trainer.events import EventPublisher, event_from_line
from loopline.trainer.registry import Job, Registry


def path_of(step: int) -> str:
    return f"{CHECKPOINTS_DIR}/{checkpoint_name(step)}"


def test_lines_become_events():
    flat = event_from_line("h", 3, json.dumps({"kind": "checkpoint", "time": 5.0, "step": 4,
                                               "path": path_of(4), "created_at": 4.5}).encode() + b"\n")
    assert (flat.seq, flat.status, flat.step) == (3, JobStatus.TRAINING, 4)
    assert flat.checkpoint.path == path_of(4) and flat.checkpoint.created_at == 4.5
    nested = event_from_line("h", 1, json.dumps({"kind": "checkpoint", "checkpoint": {
        "step": 2, "path": path_of(2), "created_at": 1.0}}).encode())
    assert nested.checkpoint.step == 2
    progress = event_from_line("h", 2, b'{"kind": "progress", "step": 1, "loss": 0.5, "grad_norm": 1.0}')
    assert progress.loss == 0.5 and progress.kind == "progress"
    assert event_from_line("h", 4, b"not json\n") is None
    assert event_from_line("h", 5, b'{"kind": "exploded"}\n') is None
    assert event_from_line("h", 6, b'{"kind": "progress", "step": "many"}\n') is None


@pytest.fixture
def registry(tmp_path):
    engine = open_database(f"sqlite:///{tmp_path / 'jobs.db'}")
    migrate(engine)
    yield Registry(engine)
    engine.dispose()


def new_job(registry: Registry, job_dir) -> Job:
    job_dir.mkdir(parents=True)
    return registry.insert(Job(
        job_hash="h1", status=JobStatus.QUEUED, params=TrainParams(), llm_name="tiny", model_path="tiny",
        adapter_type="lora", job_dir=job_dir, dataset_sha256="d", code_sha256=None, launcher="local",
        slurm_job_id=None, attempts=0, retries=0, step_at_submit=0, created_at=time.time(),
        submitted_at=None, started_at=None, finished_at=None, step=0, max_steps=0, loss=None,
        error=None, events_seq=0, events_offset=0))


def append(path, *chunks: bytes) -> None:
    """What the training program does to events.jsonl, a partial line included."""
    with open(path, "ab") as f:
        f.write(b"".join(chunks))


async def stored(js, job_hash: str) -> list[tuple[int, str]]:
    info = await js.stream_info(subjects.EVENTS_STREAM)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(subjects.EVENTS_STREAM, seq)
        event = json.loads(msg.data)
        if event["job_hash"] == job_hash:
            found.append((event["seq"], event["kind"]))
    return found


async def test_a_crash_before_the_cursor_is_stored_publishes_nothing_twice(nc, registry, tmp_path):
    js = nc.jetstream()
    publisher = EventPublisher(js, registry)
    job = new_job(registry, tmp_path / "h1")
    jobdir.append_event(job.job_dir, "queued")
    jobdir.append_event(job.job_dir, "started", step=0)
    append(job.job_dir / EVENTS_FILE, b"this line is not an event\n",
           b'{"kind": "progress", "step": 1, "loss": 2.0}\n',
           b'{"kind": "progress", "st')  # being written right now

    job = await publisher.publish_pending(job)
    assert (job.events_seq, registry.get("h1").events_seq) == (4, 4)
    assert await stored(js, "h1") == [(1, "queued"), (2, "started"), (4, "progress")]

    # The trainer died after publishing and before storing the cursor: it publishes again.
    rolled_back = registry.update(job, events_seq=0, events_offset=0)
    append(job.job_dir / EVENTS_FILE, b'ep": 2, "loss": 1.0}\n')
    job = await publisher.publish_pending(rolled_back)
    assert job.events_seq == 5
    assert await stored(js, "h1") == [(1, "queued"), (2, "started"), (4, "progress"), (5, "progress")]

    # The same hash submitted again after a delete is another job: its events are not dropped as
    # duplicates of the first one's.
    registry.delete("h1")
    again = dataclasses.replace(job, created_at=job.created_at + 1, events_seq=0, events_offset=0)
    registry.insert(again)
    await publisher.publish_pending(again)
    assert len(await stored(js, "h1")) == 8


async def test_a_jobs_last_event_is_published_once_even_across_a_crash(nc, registry, tmp_path):
    js = nc.jetstream()
    publisher = EventPublisher(js, registry)
    job = new_job(registry, tmp_path / "h1")
    jobdir.append_event(job.job_dir, "queued")
    job = await publisher.publish_pending(job)

    # Cancelled in SQL, then the trainer died before writing the event: it is written now.
    job = registry.update(job, status=JobStatus.CANCELLED, events_done=False)
    append(job.job_dir / EVENTS_FILE, b'{"kind": "progress", "step": 3}\n')
    job = await publisher.publish_final(job)
    assert job.events_done and registry.get("h1").events_done
    assert await stored(js, "h1") == [(1, "queued"), (2, "progress"), (3, "cancelled")]

    # The event was written but not published; what the run wrote after it is not news.
    job = registry.update(job, status=JobStatus.FAILED, events_done=False)
    jobdir.append_event(job.job_dir, "failed", error="boom")
    jobdir.append_event(job.job_dir, "checkpoint", step=3, path=path_of(3), created_at=1.0)
    job = await publisher.publish_final(job)
    assert job.events_done and job.events_seq == 4
    assert [kind for _, kind in await stored(js, "h1")] == ["queued", "progress", "cancelled", "failed"]
