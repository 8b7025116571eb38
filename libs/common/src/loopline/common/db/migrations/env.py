"""Alembic environment: migrations run on the connection handed in by ``engine.migrate``."""

from alembic import context

from loopline.common.db.rows import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
