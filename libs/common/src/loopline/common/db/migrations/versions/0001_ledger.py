"""The request ledger: batches, requests, dead letters.

Revision ID: 0001_ledger
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001_ledger"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("group_id", sa.String(80), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "requests",
        sa.Column("request_id", sa.String(96), primary_key=True),
        sa.Column("group_id", sa.String(80), nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("enqueued_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=True),
        sa.Column("completed_at", sa.Float, nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("replica", sa.String(128), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
    )
    op.create_index("ix_requests_group", "requests", ["group_id"])
    op.create_index("ix_requests_status", "requests", ["status"])
    op.create_index("ix_requests_completed_at", "requests", ["completed_at"])
    op.create_table(
        "dead_letters",
        sa.Column("request_id", sa.String(96), primary_key=True),
        sa.Column("stream_seq", sa.Integer, nullable=False),
        sa.Column("deliveries", sa.Integer, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("failed_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("dead_letters")
    op.drop_index("ix_requests_completed_at", "requests")
    op.drop_index("ix_requests_status", "requests")
    op.drop_index("ix_requests_group", "requests")
    op.drop_table("requests")
    op.drop_table("batches")
