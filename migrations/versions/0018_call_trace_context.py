"""A call's trace context: tool_calls.trace_context

With tracing on (OTEL_EXPORTER_OTLP_ENDPOINT), the W3C ``traceparent`` of the span that recorded
the call is kept with it, so a confirm, resume or cancel arriving later, on another connection or
another host, continues the same trace. Null with tracing off, and for the calls recorded before.

Revision ID: 0018
Revises: 0017
"""
from alembic import op
import sqlalchemy as sa

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

# what it is to the previous release's running processes (docs/operations.md, "Upgrading")
running_release = "safe"
running_release_why = "a nullable column: the previous release neither reads nor writes it"


def upgrade() -> None:
    op.add_column('tool_calls', sa.Column('trace_context', sa.Text(), nullable=True), if_not_exists=True)


def downgrade() -> None:
    """Keeps the data: the column stays (the release before never reads it); upgraded again, it is used again."""
