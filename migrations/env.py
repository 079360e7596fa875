"""Alembic environment: migrates the database in DATABASE_URL.

Each migration is its own transaction, and waits at most ``VOICE_TOOLS_MIGRATION_LOCK_TIMEOUT_MS``
(2000) for a lock (``lock_timeout``): a migration never queues behind the hot path's row locks while
every statement of the running processes queues behind it. One that times out is rolled back, and
``voice-tools migrate`` runs it again after a pause (``voice_tools/servers.py``).
"""
import os

from alembic import context
from sqlalchemy import create_engine, pool

import models
from models.calls import Base
from models.db import database_url

models.import_all()  # every backend's tables

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(database_url(), poolclass=pool.NullPool)
    lock_timeout_ms = int(os.environ.get("VOICE_TOOLS_MIGRATION_LOCK_TIMEOUT_MS", "2000"))
    with engine.connect() as connection:
        connection.exec_driver_sql(f"SET lock_timeout = {lock_timeout_ms}")  # the session's: every migration's
        connection.commit()
        context.configure(connection=connection, target_metadata=target_metadata, transaction_per_migration=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
