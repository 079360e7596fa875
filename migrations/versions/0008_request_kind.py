"""The kind of request that recorded a call: tool_calls.request_kind

``pending`` (POST /voice-tools/pending: the caller will confirm it) or ``execute``
(POST /voice-tools/execute and its legacy aliases: the relay already confirmed it). An
idempotent replay is the same call only on the same kind of request (docs/promises.md,
Idempotency): a key first used on ``/pending`` and replayed on ``/execute`` would start a call
nobody confirmed, so it is 409 ``idempotency_conflict``.

Rows recorded before this revision are classified by the reason of their first
``status_history`` entry, the only place the kind was written until now.

Revision ID: 0008
Revises: 0007
"""
from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tool_calls', sa.Column('request_kind', sa.String(length=10), nullable=False,
                                          server_default='pending'))
    op.create_check_constraint('valid_request_kind', 'tool_calls', "request_kind IN ('pending', 'execute')")
    op.execute("UPDATE tool_calls SET request_kind = 'execute' "
               "WHERE status_history -> 0 ->> 'reason' = 'Recorded (confirmed by the relay)'")


def downgrade() -> None:
    op.drop_constraint('valid_request_kind', 'tool_calls', type_='check')
    op.drop_column('tool_calls', 'request_kind')
