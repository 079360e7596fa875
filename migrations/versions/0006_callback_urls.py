"""Per-event callback URLs: tool_calls.callback_urls

A call may name a URL per event (``{"checkpoint": ..., "completed": ...}``), as a relay
written for the n8n workflows has ``/tool-progress``, ``/tool-checkpoint`` and ``/tool-complete``; the
events it does not name go to ``callback_url``.

Revision ID: 0006
Revises: 0005
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tool_calls', sa.Column('callback_urls', postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column('tool_calls', 'callback_urls')
