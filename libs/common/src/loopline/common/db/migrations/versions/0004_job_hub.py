"""Each job's push to the Hugging Face Hub (its push_to_hub param): the outcome, and the trainer's
progress on it. NULL for jobs that asked for none, and for jobs from before.

Revision ID: 0004_job_hub
Revises: 0003_job_owner
"""
import sqlalchemy as sa
from alembic import op

revision = "0004_job_hub"
down_revision = "0003_job_owner"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch: SQLite alters a table by copying it; PostgreSQL adds the columns in place.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("hub", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("hub_state", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("hub_state")
        batch.drop_column("hub")
