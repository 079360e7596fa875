"""Callers fenced from each other: idempotency keys and session context per caller

A call, its session context and its events belong to the token name that created them
(docs/promises.md, Callers). ``tool_calls.idempotency_key`` was unique over everyone: it becomes
unique per ``caller`` (a call recorded without a caller counts as ''). ``session_context``
gains ``caller`` and is keyed by (caller, session_id, context_key); the rows already
stored are given the caller of the call that stored them (``context_value.tool_call_id``),
'' when it is not known.

Revision ID: 0009
Revises: 0008
"""
from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_constraint('tool_calls_idempotency_key_key', 'tool_calls', type_='unique')
    op.create_index('uq_tool_calls_caller_idempotency_key', 'tool_calls',
                    [sa.text("coalesce(caller, '')"), 'idempotency_key'], unique=True,
                    postgresql_where=sa.text('idempotency_key IS NOT NULL'))

    op.add_column('session_context', sa.Column('caller', sa.String(length=100), nullable=False, server_default=''))
    op.execute("UPDATE session_context AS sc SET caller = t.caller FROM tool_calls AS t "
               "WHERE t.tool_call_id = sc.context_value ->> 'tool_call_id' AND t.caller IS NOT NULL")
    op.drop_constraint('uq_session_context_key', 'session_context', type_='unique')
    op.create_unique_constraint('uq_session_context_key', 'session_context', ['caller', 'session_id', 'context_key'])


def downgrade() -> None:
    # one row per (session_id, context_key) again: the newest of each wins
    op.execute("DELETE FROM session_context AS a USING session_context AS b "
               "WHERE a.session_id = b.session_id AND a.context_key = b.context_key "
               "AND (a.created_at, a.id::text) < (b.created_at, b.id::text)")
    op.drop_constraint('uq_session_context_key', 'session_context', type_='unique')
    op.create_unique_constraint('uq_session_context_key', 'session_context', ['session_id', 'context_key'])
    op.drop_column('session_context', 'caller')

    # keys unique over everyone again: a key two callers used stays on the oldest call only
    op.execute("UPDATE tool_calls AS a SET idempotency_key = NULL FROM tool_calls AS b "
               "WHERE a.idempotency_key = b.idempotency_key AND (a.created_at, a.id::text) > (b.created_at, b.id::text)")
    op.drop_index('uq_tool_calls_caller_idempotency_key', table_name='tool_calls')
    op.create_unique_constraint('tool_calls_idempotency_key_key', 'tool_calls', ['idempotency_key'])
