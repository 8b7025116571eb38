"""SQL rows. Kept apart from wire schemas and internal types: a column rename never changes a
message, and a message field never leaks into the schema without a migration."""

from __future__ import annotations

from sqlalchemy import Float, Index, Integer, String, Text
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
