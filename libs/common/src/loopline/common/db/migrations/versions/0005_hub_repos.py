"""The Hub repos the trainer created for jobs' pushes, so that a push to a repo it did not create
can be refused.

Revision ID: 0005_hub_repos
Revises: 0004_job_hub
"""
import sqlalchemy as sa
from alembic import op

revision = "0005_hub_repos"
down_revision = "0004_job_hub"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hub_repos",
        sa.Column("repo_id", sa.String(256), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("job_hash", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("hub_repos")
