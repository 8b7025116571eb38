"""The API key that submitted each job (NULL for jobs from before, or from a gateway without keys).

Revision ID: 0003_job_owner
Revises: 0002_jobs
"""
import sqlalchemy as sa
from alembic import op

revision = "0003_job_owner"
down_revision = "0002_jobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch: SQLite alters a table by copying it; PostgreSQL adds the column in place.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("owner", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("owner")
