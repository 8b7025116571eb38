"""The job registry on SQLite and PostgreSQL: naming jobs by hash, prefix or ``latest``."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from loopline.common.contracts.job_schemas import JobStatus
from loopline.common.contracts.train_params import TrainParams, canonical
from loopline.common.db.engine import migrate, open_database
from loopline.trainer.errors import InvalidRequest, JobNotFound
from loopline.trainer.registry import Job, Registry


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def registry(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobs.db'}"
    else:
        server = request.getfixturevalue("postgres_url")
        name = f"trainer_{uuid.uuid4().hex[:12]}"
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = server.rsplit("/", 1)[0] + "/" + name
    engine = open_database(url)
    migrate(engine)
    yield Registry(engine)
    engine.dispose()
    if request.param == "postgres":
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def job(job_hash: str, created_at: float, **changes) -> Job:
    base = Job(
        job_hash=job_hash, status=JobStatus.QUEUED, params=TrainParams(max_steps=3, lora_config={"r": 8}),
        llm_name="tiny", model_path="/models/tiny", adapter_type="lora", job_dir=Path(f"/jobs/{job_hash}"),
        dataset_sha256="d" * 64, code_sha256=None, launcher="slurm", slurm_job_id=None, attempts=0,
        retries=0, step_at_submit=0, created_at=created_at, submitted_at=None, started_at=None,
        finished_at=None, step=0, max_steps=3, loss=None, error=None, events_seq=0, events_offset=0)
    return dataclasses.replace(base, **changes)


def test_jobs_are_named_by_hash_prefix_or_latest(registry):
    registry.insert(job("ab_1", 1.0))
    registry.insert(job("ab%2", 2.0, status=JobStatus.COMPLETED))
    registry.insert(job("cd3", 3.0))
    registry.insert(job("ef4", 0.5, status=JobStatus.CANCELLED, events_done=True))
    assert registry.resolve("cd").job_hash == "cd3"
    assert registry.resolve("latest").job_hash == "cd3"
    assert canonical(registry.resolve("ab_1").params) == {"max_steps": 3, "lora_config": {"r": 8}}
    # '_' and '%' are plain characters in a prefix, not SQL wildcards.
    assert registry.resolve("ab_").job_hash == "ab_1"
    assert registry.resolve("ab%").job_hash == "ab%2"
    with pytest.raises(InvalidRequest):
        registry.resolve("ab")
    with pytest.raises(JobNotFound):
        registry.resolve("zz")
    assert [j.job_hash for j in registry.list()] == ["cd3", "ab%2", "ab_1", "ef4"]
    # Unfinished, or finished with its last event not yet published (ab%2).
    assert [j.job_hash for j in registry.to_reconcile()] == ["ab_1", "ab%2", "cd3"]
    assert registry.counts() == {"QUEUED": 2, "COMPLETED": 1, "CANCELLED": 1}


def test_updates_and_deletes(registry):
    first = registry.insert(job("h1", 1.0))
    updated = registry.update(first, status=JobStatus.TRAINING, slurm_job_id="42", attempts=1,
                              events_offset=2**40)
    assert updated == registry.get("h1")
    assert (updated.status, updated.slurm_job_id, updated.events_offset) == (JobStatus.TRAINING, "42", 2**40)
    registry.delete("h1")
    assert registry.get("h1") is None
    with pytest.raises(JobNotFound):
        registry.resolve("latest")


def test_a_push_to_the_hub_is_due_until_done(registry):
    from loopline.common.contracts.hub_push import HubPush
    from loopline.trainer.registry import HUB_DONE, HUB_PENDING, HUB_UNPUBLISHED

    pending = HubPush(repo_id="org/m", revision="main", status="pending")
    first = registry.insert(job("hub1", 1.0, status=JobStatus.COMPLETED, finished_at=2.0, hub=pending,
                                hub_state=HUB_PENDING))
    registry.insert(job("hub2", 2.0, status=JobStatus.COMPLETED, finished_at=1.0))  # asked for none
    assert [j.job_hash for j in registry.to_push()] == ["hub1"]
    pushed = HubPush(repo_id="org/m", revision="main", status="pushed", url="https://hub/c/1",
                     commit="1" * 40)
    registry.update(first, hub=pushed, hub_state=HUB_UNPUBLISHED)
    assert registry.get("hub1").hub == pushed and [j.job_hash for j in registry.to_push()] == ["hub1"]
    registry.update(first, hub_state=HUB_DONE)
    assert registry.to_push() == [] and registry.get("hub1").hub == pushed
    assert registry.get("hub2").hub is None
