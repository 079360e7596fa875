"""Training tables (learners, modules, progress, questions) for get_training_progress and knowledge_check

Revision ID: 0005
Revises: 0004
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
