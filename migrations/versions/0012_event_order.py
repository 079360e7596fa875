"""Events ordered within this database's own commits (filled in by the stream work)

Revision ID: 0012
Revises: 0011
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
