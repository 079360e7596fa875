"""A chunk's code blocks, searched but never read out: documents.code, and search_text over it

``code`` holds the code blocks of a chunk's part of its document (a Markdown README's examples),
one a line; '' for the chunks stored before (they are read again at their next ingest). The
text a search reads out stays ``content``; the code is embedded after it and its words join
``search_text`` (weight D, as the text), which is made again with the new expression: the
table is rewritten once, under a lock, by this migration.

Revision ID: 0016
Revises: 0015
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

# the same expression as models/documents.py's SEARCH_TEXT
SEARCH_TEXT = ("setweight(to_tsvector('english'::regconfig, title), 'A') || "
               "setweight(to_tsvector('english'::regconfig, coalesce(metadata ->> 'section', '')), 'B') || "
               "setweight(to_tsvector('english'::regconfig, content), 'D') || "
               "setweight(to_tsvector('english'::regconfig, code), 'D')")
# 0013's
BEFORE = ("setweight(to_tsvector('english'::regconfig, title), 'A') || "
          "setweight(to_tsvector('english'::regconfig, coalesce(metadata ->> 'section', '')), 'B') || "
          "setweight(to_tsvector('english'::regconfig, content), 'D')")


def _search_text(expression: str) -> None:
    op.drop_index('ix_documents_search_text', table_name='documents')
    op.drop_column('documents', 'search_text')
    op.add_column('documents', sa.Column('search_text', postgresql.TSVECTOR(),
                                         sa.Computed(expression, persisted=True), nullable=True))
    op.create_index('ix_documents_search_text', 'documents', ['search_text'], postgresql_using='gin')


def upgrade() -> None:
    op.add_column('documents', sa.Column('code', sa.Text(), server_default='', nullable=False))
    _search_text(SEARCH_TEXT)


def downgrade() -> None:
    _search_text(BEFORE)
    op.drop_column('documents', 'code')
