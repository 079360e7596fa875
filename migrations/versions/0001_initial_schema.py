"""initial schema: tool_calls, session_context, callback_deliveries, local backend tables

A trigger NOTIFYs channel ``tool_call_status`` with the tool_call_id whenever a
call's status changes, so ``?wait=`` listens instead of polling.

Revision ID: 0001
Revises: 
Create Date: 2026-11-22 18:44:39.272087
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None

NOTIFY_FUNCTION = """
CREATE FUNCTION notify_tool_call_status() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('tool_call_status', NEW.tool_call_id);
    RETURN NEW;
END;
$$ LANGUAGE plpgsql
"""

NOTIFY_TRIGGER = """
CREATE TRIGGER tool_calls_status_notify
AFTER UPDATE OF status ON tool_calls
FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
EXECUTE FUNCTION notify_tool_call_status()
"""


def upgrade() -> None:
    op.create_table('documents',
    sa.Column('id', sa.String(length=100), nullable=False),
    sa.Column('title', sa.Text(), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('email_outbox',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('tool_call_id', sa.String(length=100), nullable=False),
    sa.Column('message_id', sa.String(length=200), nullable=False),
    sa.Column('thread_id', sa.String(length=100), nullable=False),
    sa.Column('headers', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('sent_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('tool_call_id')
    )
    op.create_table('session_context',
    sa.Column('id', sa.UUID(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('session_id', sa.String(length=100), nullable=False),
    sa.Column('context_key', sa.String(length=100), nullable=False),
    sa.Column('context_value', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('session_id', 'context_key', name='uq_session_context_key')
    )
    op.create_index('idx_session_context_expires', 'session_context', ['expires_at'], unique=False)
    op.create_table('tool_calls',
    sa.Column('id', sa.UUID(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('tool_call_id', sa.String(length=100), nullable=False),
    sa.Column('session_id', sa.String(length=100), nullable=False),
    sa.Column('connection_id', sa.String(length=100), nullable=True),
    sa.Column('intent_id', sa.String(length=100), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('function_name', sa.String(length=100), nullable=False),
    sa.Column('action_level', sa.String(length=10), nullable=False),
    sa.Column('parameters', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('parameters_history', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('status', sa.String(length=20), server_default='PENDING', nullable=False),
    sa.Column('status_history', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('current_step', sa.String(length=50), nullable=True),
    sa.Column('progress', sa.Float(), server_default=sa.text('0'), nullable=False),
    sa.Column('step_outputs', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('committed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('callback_url', sa.Text(), nullable=True),
    sa.Column('workflow_id', sa.String(length=100), nullable=True),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('voice_response', sa.Text(), nullable=True),
    sa.Column('context_key', sa.String(length=100), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('redrives', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('event_seq', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('caller', sa.String(length=100), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('confirmed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('executed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('prepared_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('resumed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('execution_time_ms', sa.Integer(), nullable=True),
    sa.CheckConstraint("action_level IN ('read', 'draft', 'write')", name='valid_action_level'),
    sa.CheckConstraint("status IN ('PENDING', 'MODIFIED', 'EXECUTING', 'PREPARED', 'COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')", name='valid_status'),
    sa.CheckConstraint('progress >= 0 AND progress <= 1', name='valid_progress'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('idempotency_key'),
    sa.UniqueConstraint('tool_call_id')
    )
    op.create_index('idx_tool_calls_open_status', 'tool_calls', ['status', 'created_at'], unique=False, postgresql_where=sa.text("status IN ('PENDING', 'PREPARED', 'EXECUTING')"))
    op.create_index('idx_tool_calls_session', 'tool_calls', ['session_id', sa.literal_column('created_at DESC')], unique=False)
    op.create_index('idx_tool_calls_status', 'tool_calls', ['session_id', 'status'], unique=False)
    op.create_table('callback_deliveries',
    sa.Column('id', sa.UUID(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.Column('tool_call_id', sa.String(length=100), nullable=False),
    sa.Column('event', sa.String(length=20), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('state', sa.String(length=10), server_default='pending', nullable=False),
    sa.Column('attempts', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('attempt_log', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('response_code', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("state IN ('pending', 'delivered', 'failed')", name='valid_delivery_state'),
    sa.ForeignKeyConstraint(['tool_call_id'], ['tool_calls.tool_call_id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('event_id'),
    sa.UniqueConstraint('tool_call_id', 'seq', name='uq_callback_seq')
    )
    op.create_index('idx_callback_due', 'callback_deliveries', ['next_attempt_at'], unique=False, postgresql_where=sa.text("state = 'pending'"))
    op.execute(NOTIFY_FUNCTION)
    op.execute(NOTIFY_TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS tool_calls_status_notify ON tool_calls")
    op.execute("DROP FUNCTION IF EXISTS notify_tool_call_status()")
    op.drop_index('idx_callback_due', table_name='callback_deliveries', postgresql_where=sa.text("state = 'pending'"))
    op.drop_table('callback_deliveries')
    op.drop_index('idx_tool_calls_status', table_name='tool_calls')
    op.drop_index('idx_tool_calls_session', table_name='tool_calls')
    op.drop_index('idx_tool_calls_open_status', table_name='tool_calls', postgresql_where=sa.text("status IN ('PENDING', 'PREPARED', 'EXECUTING')"))
    op.drop_table('tool_calls')
    op.drop_index('idx_session_context_expires', table_name='session_context')
    op.drop_table('session_context')
    op.drop_table('email_outbox')
    op.drop_table('documents')
