"""The job registry in SQL (``jobs`` table), ``Job``, the trainer's internal view of a row, and
the registry's job counts as Prometheus gauges (``job_count_families``).

Methods are synchronous (SQLAlchemy); the service calls them through ``asyncio.to_thread``. Each
call is its own short transaction: the per-job lock in control.py, not SQL, orders the changes
made to one job.
"""

from __future__ import annotations

import builtins
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from loopline.common.contracts.hub_push import HubPush
from loopline.common.contracts.job_schemas import JobStatus, OwnerFilter
from loopline.common.contracts.train_params import TrainParams, canonical
from loopline.common.db.rows import JobRow
from loopline.trainer.errors import InvalidRequest, JobNotFound

LATEST = "latest"
# The trainer's progress on a job's push (JobRow.hub_state): to push; pushed or failed, its hub
# event not acknowledged yet; done.
HUB_PENDING, HUB_UNPUBLISHED, HUB_DONE = "pending", "unpublished", "done"


@dataclass(frozen=True)
class Job:
    job_hash: str
    status: JobStatus
    params: TrainParams  # as submitted (llm_name filled in); SQL keeps their canonical form
    llm_name: str
    model_path: str
    adapter_type: str
    job_dir: Path
    dataset_sha256: str
    code_sha256: str | None
    launcher: str
    slurm_job_id: str | None
    attempts: int
    retries: int
    step_at_submit: int
    created_at: float
    submitted_at: float | None
    started_at: float | None
    finished_at: float | None
    step: int
    max_steps: int
    loss: float | None
    error: str | None
    events_seq: int
    events_offset: int
    events_done: bool = False
    owner: str | None = None  # the API key that submitted it (JobSubmit.owner)
    hub: HubPush | None = None  # its push_to_hub, from COMPLETED on (hub_loop.py)
    hub_state: str | None = None  # HUB_PENDING, HUB_UNPUBLISHED, HUB_DONE

    @property
    def ranks(self) -> int:
        return self.params.tensor_parallel or 1

    @property
    def msg_id_prefix(self) -> str:
        """Nats-Msg-Id prefix of this job's events. The creation time (ms) tells a job deleted and
        submitted again (same hash, seq from 1 again) from the first one, which the stream's
        dedupe window would otherwise drop as duplicates."""
        return f"{self.job_hash}.{int(self.created_at * 1000)}"

    @classmethod
    def from_row(cls, row: JobRow) -> Job:
        values = {f.name: getattr(row, f.name) for f in dataclasses.fields(cls)}
        values["status"] = JobStatus(row.status)
        values["job_dir"] = Path(row.job_dir)
        values["params"] = TrainParams.model_validate(row.params or {})
        values["hub"] = HubPush.model_validate(row.hub) if row.hub else None
        return cls(**values)

    def to_row(self) -> JobRow:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["status"] = self.status.value
        values["job_dir"] = str(self.job_dir)
        values["params"] = canonical(self.params)
        values["hub"] = self.hub.model_dump(mode="json") if self.hub else None
        return JobRow(**values)


class Registry:
    def __init__(self, engine: Engine):
        self.engine = engine

    def get(self, job_hash: str) -> Job | None:
        with Session(self.engine) as s:
            row = s.get(JobRow, job_hash)
            return Job.from_row(row) if row else None

    def resolve(self, ref: str, owner: OwnerFilter = None) -> Job:
        """A job by its hash, a unique prefix of it, or ``latest`` (the newest), among ``owner``'s
        jobs (every job when None): another key's job is the same 404 as one that does not exist,
        and neither ``latest`` nor a prefix ever names it or counts it."""
        ref = ref.strip()
        if not ref:
            raise InvalidRequest("no job named: give a job hash, a prefix of one, or 'latest'")
        visible = sa.true() if owner is None else JobRow.owner == owner
        with Session(self.engine) as s:
            if ref == LATEST:
                row = s.scalars(sa.select(JobRow).where(visible)
                                .order_by(JobRow.created_at.desc()).limit(1)).first()
                if row is None:
                    raise JobNotFound("there are no training jobs yet")
                return Job.from_row(row)
            row = s.get(JobRow, ref)
            if row is not None and (owner is None or row.owner == owner):
                return Job.from_row(row)
            escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            rows = s.scalars(
                sa.select(JobRow).where(visible, JobRow.job_hash.like(f"{escaped}%", escape="\\")).limit(2)
            ).all()
        if not rows:
            raise JobNotFound(f"no training job {ref!r}")
        if len(rows) > 1:
            raise InvalidRequest(f"{ref!r} names more than one job: give more of the hash")
        return Job.from_row(rows[0])

    def list(self, owner: OwnerFilter = None) -> builtins.list[Job]:
        """Newest first, ``owner``'s jobs only (every job when None)."""
        visible = sa.true() if owner is None else JobRow.owner == owner
        with Session(self.engine) as s:
            rows = s.scalars(sa.select(JobRow).where(visible).order_by(JobRow.created_at.desc())).all()
            return [Job.from_row(r) for r in rows]

    def to_reconcile(self) -> builtins.list[Job]:  # in this class, `list` is the method above
        """Unfinished jobs, and finished ones whose last event is not published yet."""
        live = (JobStatus.QUEUED.value, JobStatus.TRAINING.value)
        with Session(self.engine) as s:
            query = (sa.select(JobRow).where(JobRow.status.in_(live) | sa.not_(JobRow.events_done))
                     .order_by(JobRow.created_at))
            return [Job.from_row(r) for r in s.scalars(query).all()]

    def to_push(self) -> builtins.list[Job]:
        """COMPLETED jobs whose push to the Hub is not done: not tried yet, or its event unpublished."""
        with Session(self.engine) as s:
            query = (sa.select(JobRow).where(JobRow.status == JobStatus.COMPLETED.value,
                                             JobRow.hub_state.in_((HUB_PENDING, HUB_UNPUBLISHED)))
                     .order_by(JobRow.finished_at))
            return [Job.from_row(r) for r in s.scalars(query).all()]

    def insert(self, job: Job) -> Job:
        with Session(self.engine) as s, s.begin():
            s.add(job.to_row())
        return job

    def update(self, job: Job, **changes: Any) -> Job:
        """Write ``changes`` to the job's row; returns the job as it is now."""
        new = dataclasses.replace(job, **changes)
        columns = {k: getattr(new, k) for k in changes}
        if "status" in columns:
            columns["status"] = new.status.value
        if "job_dir" in columns:
            columns["job_dir"] = str(new.job_dir)
        if "params" in columns:
            columns["params"] = canonical(new.params)
        if "hub" in columns:
            columns["hub"] = new.hub.model_dump(mode="json") if new.hub else None
        with Session(self.engine) as s, s.begin():
            s.execute(sa.update(JobRow).where(JobRow.job_hash == job.job_hash).values(**columns))
        return new

    def delete(self, job_hash: str) -> None:
        with Session(self.engine) as s, s.begin():
            s.execute(sa.delete(JobRow).where(JobRow.job_hash == job_hash))

    def counts(self) -> dict[str, int]:
        with Session(self.engine) as s:
            rows = s.execute(sa.select(JobRow.status, sa.func.count()).group_by(JobRow.status)).all()
            return dict(rows)


def job_count_families(counts: dict[str, int] | None) -> list[Metric]:
    """``loopline_trainer_jobs``: the registry's jobs by status (``counts``), every status present
    (0 when no job has it); without samples for None (see StateCollector)."""
    jobs = GaugeMetricFamily("loopline_trainer_jobs", "Training jobs in the registry, by status.",
                             labels=["status"])
    if counts is not None:
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
    return [jobs]
