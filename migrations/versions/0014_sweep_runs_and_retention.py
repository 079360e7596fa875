"""Beat's sweeps claimed once per period; the indexes of the retention purge

``sweep_runs``: one row per sweep and period. Any number of beats may send a sweep; the first
of its runs in a period inserts the row (``INSERT … ON CONFLICT DO NOTHING``) and does the
work, the others find the row there and do nothing (``models/sweep_runs.py``).

``idx_tool_calls_ended`` (ended calls by ``completed_at``) and ``idx_callback_settled`` (events
no longer pending by ``created_at``): the retention purge finds its oldest rows by them, a small
batch at a time (``models/retention.py``). Both are built ``CONCURRENTLY``, outside the
migration's transaction, so a large table keeps taking writes while they are built.

Revision ID: 0014
Revises: 0013
"""
from alembic import op
import sqlalchemy as sa

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

ENDED = "status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')"
SETTLED = "state <> 'pending'"


def upgrade() -> None:
    op.create_table(
        'sweep_runs',
        sa.Column('sweep', sa.String(length=100), nullable=False),
        sa.Column('period_start', sa.DateTime(timezone=True), nullable=False),
        sa.Column('claimed_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('claimed_by', sa.String(length=200), nullable=True),
        sa.PrimaryKeyConstraint('sweep', 'period_start'),
    )
    with op.get_context().autocommit_block():
        op.create_index('idx_tool_calls_ended', 'tool_calls', ['completed_at'], postgresql_where=sa.text(ENDED),
                        postgresql_concurrently=True, if_not_exists=True)
        op.create_index('idx_callback_settled', 'callback_deliveries', ['created_at'],
                        postgresql_where=sa.text(SETTLED), postgresql_concurrently=True, if_not_exists=True)


def downgrade() -> None:
    op.drop_index('idx_callback_settled', table_name='callback_deliveries')
    op.drop_index('idx_tool_calls_ended', table_name='tool_calls')
    op.drop_table('sweep_runs')
