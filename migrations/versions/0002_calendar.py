"""Local calendar tables (calendar_events) for schedule_meeting and get_calendar_availability

Revision ID: 0002
Revises: 0001
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'calendar_events',
        sa.Column('id', sa.String(length=200), nullable=False),
        sa.Column('title', sa.Text(), nullable=False),
        sa.Column('starts_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('ends_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('timezone', sa.String(length=64), server_default='UTC', nullable=False),
        sa.Column('attendees', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"),
                  nullable=False),
        sa.Column('description', sa.Text(), server_default='', nullable=False),
        sa.Column('tool_call_id', sa.String(length=100), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.CheckConstraint('ends_at > starts_at', name='calendar_event_ends_after_start'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('tool_call_id'),
    )
    op.create_index('idx_calendar_events_span', 'calendar_events', ['starts_at', 'ends_at'], unique=False)


def downgrade() -> None:
    op.drop_index('idx_calendar_events_span', table_name='calendar_events')
    op.drop_table('calendar_events')
