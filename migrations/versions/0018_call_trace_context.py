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


def upgrade() -> None:
    op.add_column('tool_calls', sa.Column('trace_context', sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column('tool_calls', 'trace_context')
