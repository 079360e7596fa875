"""Full-text search beside the vector search: documents.search_text and its GIN index

``search_text`` is a stored generated ``tsvector`` (the ``english`` configuration) of a chunk's
title (weight A), section path (``metadata->>'section'``, weight B) and text (weight D), so
every row, including those already stored, has it without the ingest writing it. A search
ranks chunks by it (``ts_rank_cd``) beside the HNSW vector ranking and fuses the two
(``voice_tools_backends/documents.py``). The GIN index serves the ``@@`` match.

Revision ID: 0013
Revises: 0012
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

# the same expression as models/documents.py's SEARCH_TEXT
SEARCH_TEXT = ("setweight(to_tsvector('english'::regconfig, title), 'A') || "
               "setweight(to_tsvector('english'::regconfig, coalesce(metadata ->> 'section', '')), 'B') || "
               "setweight(to_tsvector('english'::regconfig, content), 'D')")


def upgrade() -> None:
    op.add_column('documents', sa.Column('search_text', postgresql.TSVECTOR(),
                                         sa.Computed(SEARCH_TEXT, persisted=True), nullable=True))
    op.create_index('ix_documents_search_text', 'documents', ['search_text'], postgresql_using='gin')


def downgrade() -> None:
    op.drop_index('ix_documents_search_text', table_name='documents')
    op.drop_column('documents', 'search_text')
