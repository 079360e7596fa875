"""Document chunks with pgvector embeddings for query_vector_db and search_documentation

Revision ID: 0004
Revises: 0003
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
