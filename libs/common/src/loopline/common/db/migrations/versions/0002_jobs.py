"""The trainer's job registry.

Revision ID: 0002_jobs
Revises: 0001_ledger
"""
import sqlalchemy as sa
from alembic import op

revision = "0002_jobs"
down_revision = "0001_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_hash", sa.String(128), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("llm_name", sa.String(512), nullable=False),
        sa.Column("model_path", sa.String(1024), nullable=False),
        sa.Column("adapter_type", sa.String(32), nullable=False),
        sa.Column("job_dir", sa.String(1024), nullable=False),
        sa.Column("dataset_sha256", sa.String(64), nullable=False),
        sa.Column("code_sha256", sa.String(64), nullable=True),
        sa.Column("launcher", sa.String(16), nullable=False),
        sa.Column("slurm_job_id", sa.String(64), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("retries", sa.Integer, nullable=False, server_default="0"),
        sa.Column("step_at_submit", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("submitted_at", sa.Float, nullable=True),
        sa.Column("started_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("step", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_steps", sa.Integer, nullable=False, server_default="0"),
        sa.Column("loss", sa.Float, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("events_seq", sa.Integer, nullable=False, server_default="0"),
        sa.Column("events_offset", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("events_done", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_created_at", "jobs")
    op.drop_index("ix_jobs_status", "jobs")
    op.drop_table("jobs")
