"""The document store: one row per CHUNK of a document, with its embedding.

Searched by query_vector_db and search_documentation (``voice_tools_backends/documents.py``).
Every chunk records the model that embedded it and the vector's size, so a search
never compares vectors of two models. ``embedding`` is a pgvector ``vector(384)``
with an HNSW index (cosine); on a PostgreSQL without pgvector the migration leaves
the column out and the backend says how to fix it. ``search_text`` is a generated
``tsvector`` of the title, section path, text and code (GIN index), for the full-text half
of a search. ``code`` holds the chunk's code blocks: searched, never read out.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from pgvector.sqlalchemy import Vector
from sqlalchemy import Computed, DateTime, Index, Integer, String, Text, func
from sqlalchemy.dialects.postgresql import JSONB, TSVECTOR
from sqlalchemy.orm import Mapped, mapped_column

from models.calls import Base

EMBEDDING_DIM = 384
SEARCH_CONFIG = "english"  # the text search configuration of search_text and of a search's query
# title (A), section path (B), text and code (D) of a chunk, for PostgreSQL's full-text search (migration 0016)
SEARCH_TEXT = ("setweight(to_tsvector('english'::regconfig, title), 'A') || "
               "setweight(to_tsvector('english'::regconfig, coalesce(metadata ->> 'section', '')), 'B') || "
               "setweight(to_tsvector('english'::regconfig, content), 'D') || "
               "setweight(to_tsvector('english'::regconfig, code), 'D')")


class DocumentChunk(Base):
    """A chunk of a document of ``owner`` ('' for the shared documents every caller searches): ``id`` is
    ``<document_id>#<chunk_index>``, unique within an owner's documents."""

    __tablename__ = "documents"

    owner: Mapped[str] = mapped_column(String(100), primary_key=True, server_default="")
    id: Mapped[str] = mapped_column(Text, primary_key=True)
    document_id: Mapped[str] = mapped_column(Text, nullable=False)
    source: Mapped[str] = mapped_column(Text, nullable=False)
    title: Mapped[str] = mapped_column(Text, nullable=False)
    chunk_index: Mapped[int] = mapped_column(Integer, nullable=False)
    content: Mapped[str] = mapped_column(Text, nullable=False)
    code: Mapped[str] = mapped_column(Text, nullable=False, server_default="")  # searched, never read out
    doc_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, nullable=False, server_default="{}")
    embedding: Mapped[Any] = mapped_column(Vector(EMBEDDING_DIM), nullable=False)
    embedding_model: Mapped[str] = mapped_column(Text, nullable=False)
    embedding_dim: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    search_text: Mapped[Any] = mapped_column(TSVECTOR, Computed(SEARCH_TEXT, persisted=True), nullable=True)

    __table_args__ = (
        Index("ix_documents_owner_document_id", "owner", "document_id"),
        Index("ix_documents_embedding_model", "embedding_model"),
        Index("ix_documents_metadata", "metadata", postgresql_using="gin"),
        Index("ix_documents_search_text", "search_text", postgresql_using="gin"),
        Index("ix_documents_embedding_hnsw", "embedding", postgresql_using="hnsw",
              postgresql_with={"m": 16, "ef_construction": 64}, postgresql_ops={"embedding": "vector_cosine_ops"}),
    )


Document = DocumentChunk  # the name the table had before it held chunks
