"""Document chunks with pgvector embeddings for query_vector_db and search_documentation

``documents`` becomes a table of chunks (``id`` = ``<document_id>#<n>``): the old
full-text rows were demo rows and are dropped (``voice-tools load-demo`` brings the
demo documents back, embedded). With pgvector available the chunk carries
``embedding vector(384)`` and an HNSW index (``vector_cosine_ops``). A PostgreSQL
without pgvector (e.g. a stock PostgreSQL 15) still migrates: the column and its
index are left out, and the first search or ingest says how to fix it. Running the
migrations again on a server where pgvector has since been installed does not add
the column: downgrade to 0003 and upgrade again (the chunks are re-ingested).

Revision ID: 0004
Revises: 0003
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401
from sqlalchemy.dialects import postgresql

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

EMBEDDING_DIM = 384


def _pgvector() -> bool:
    """Is the ``vector`` extension installed, or can it be? (never fails the migration)"""
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT 1 FROM pg_extension WHERE extname = 'vector'")).first():
        return True
    if not bind.execute(sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).first():
        return False
    try:
        with bind.begin_nested():  # a savepoint: a refused CREATE EXTENSION (privileges) must not end the migration
            bind.execute(sa.text("CREATE EXTENSION IF NOT EXISTS vector"))
        return True
    except sa.exc.DBAPIError:
        return False


def upgrade() -> None:
    op.drop_table('documents')
    with_vectors = _pgvector()
    columns = [
        sa.Column('id', sa.Text(), nullable=False),
        sa.Column('document_id', sa.Text(), nullable=False),
        sa.Column('source', sa.Text(), nullable=False),
        sa.Column('title', sa.Text(), nullable=False),
        sa.Column('chunk_index', sa.Integer(), nullable=False),
        sa.Column('content', sa.Text(), nullable=False),
        sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
        sa.Column('embedding_model', sa.Text(), nullable=False),
        sa.Column('embedding_dim', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    ]
    op.create_table('documents', *columns)
    op.create_index('ix_documents_document_id', 'documents', ['document_id'])
    op.create_index('ix_documents_embedding_model', 'documents', ['embedding_model'])
    op.create_index('ix_documents_metadata', 'documents', ['metadata'], postgresql_using='gin')
    if with_vectors:
        op.execute(f"ALTER TABLE documents ADD COLUMN embedding vector({EMBEDDING_DIM}) NOT NULL")
        op.execute("CREATE INDEX ix_documents_embedding_hnsw ON documents "
                   "USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64)")


def downgrade() -> None:
    op.drop_table('documents')  # its indexes go with it; the extension stays (other databases may use it)
    op.create_table(
        'documents',
        sa.Column('id', sa.String(length=100), nullable=False),
        sa.Column('title', sa.Text(), nullable=False),
        sa.Column('content', sa.Text(), nullable=False),
        sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
