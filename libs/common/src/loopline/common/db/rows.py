"""SQL rows. Kept apart from wire schemas and internal types: a column rename never changes a
message, and a message field never leaks into the schema without a migration."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class BatchRow(Base):
    """One client submission: a /v1/generate call, an upload, or one OpenAI request."""

    __tablename__ = "batches"

    group_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(512))
    total: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)


class RequestRow(Base):
    """One prompt of a batch and what became of it."""

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_group", "group_id"),
        Index("ix_requests_status", "status"),
        Index("ix_requests_completed_at", "completed_at"),
    )

    request_id: Mapped[str] = mapped_column(String(96), primary_key=True)
    group_id: Mapped[str] = mapped_column(String(80))
    idx: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(512))
    # queued -> completed | failed
    status: Mapped[str] = mapped_column(String(16))
    enqueued_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    replica: Mapped[str | None] = mapped_column(String(128), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class DeadLetterRow(Base):
    """A request that exhausted its deliveries; kept for inspection after it was failed."""

    __tablename__ = "dead_letters"

    request_id: Mapped[str] = mapped_column(String(96), primary_key=True)
    stream_seq: Mapped[int] = mapped_column(Integer)
    deliveries: Mapped[int] = mapped_column(Integer)
    payload: Mapped[str] = mapped_column(Text)
    failed_at: Mapped[float] = mapped_column(Float)


class JobRow(Base):
    """One training job in the trainer's registry. The loss history is not here: it lives in the
    job directory's status.json, written by the training program, and is read from there."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_status", "status"),
        Index("ix_jobs_created_at", "created_at"),
    )

    job_hash: Mapped[str] = mapped_column(String(128), primary_key=True)
    # QUEUED -> TRAINING -> COMPLETED | FAILED | CANCELLED (job_schemas.JobStatus)
    status: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    llm_name: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str] = mapped_column(String(1024))
    adapter_type: Mapped[str] = mapped_column(String(32))
    job_dir: Mapped[str] = mapped_column(String(1024))
    dataset_sha256: Mapped[str] = mapped_column(String(64))
    code_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Which launcher runs it ("slurm" | "local") and its id there (the Slurm job id).
    launcher: Mapped[str] = mapped_column(String(16))
    slurm_job_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Submissions so far (sbatch calls), and those in a row that ended without progress.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    retries: Mapped[int] = mapped_column(Integer, default=0)
    step_at_submit: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    submitted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    step: Mapped[int] = mapped_column(Integer, default=0)
    max_steps: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Cursor into the job's events.jsonl: lines published so far (= the last event's seq) and the
    # byte offset just after them. Moved only after JetStream acknowledged those lines.
    events_seq: Mapped[int] = mapped_column(Integer, default=0)
    events_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    # A finished job's last event (completed, failed, cancelled) is published; until then the
    # reconcile loop keeps publishing for it, even though the job is finished.
    events_done: Mapped[bool] = mapped_column(Boolean, default=False)
    # The API key that submitted the job (JobSubmit.owner); NULL when the gateway has no keys.
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The push to the Hugging Face Hub (contracts/hub_push.HubPush as JSON), NULL when none was
    # asked for; hub_state is the trainer's own progress on it: "pending" (to push), "unpublished"
    # (pushed or failed, its hub event not acknowledged yet), "done".
    hub: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    hub_state: Mapped[str | None] = mapped_column(String(16), nullable=True)


class HubRepoRow(Base):
    """A Hub repo the trainer created for a job's push_to_hub: the repos it may push to again
    without LOOPLINE_HUB_ALLOW_EXISTING_REPOS. Kept when the job is deleted: the repo outlives it."""

    __tablename__ = "hub_repos"

    repo_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    # The API key whose job created it (JobSubmit.owner); NULL when the gateway has no keys.
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    job_hash: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
