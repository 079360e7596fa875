"""Side effects claimed by one copy at a time, attempts counted, and each call's outcome

A side-effect step is claimed by the statement that passes the point of no return:
``effect_claimed_until`` (the claim's lease, as long as the step's hard time limit) and
``effect_claimed_by`` (the claiming attempt's token) say who holds it, ``effect_attempts`` how
many attempts of the effect have claimed it (more than one: an earlier attempt may have acted).
``step_attempts`` counts the runs of the current step (the bound of its retries, even when the
broker refuses the retries' publishes). ``outcome`` says whether the call's action happened:
``done``, ``not_done`` or ``unconfirmed`` (docs/promises.md, "Exactly once").

Revision ID: 0010
Revises: 0009
"""
from alembic import op
import sqlalchemy as sa

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tool_calls', sa.Column('effect_claimed_until', sa.DateTime(timezone=True)))
    op.add_column('tool_calls', sa.Column('effect_claimed_by', sa.String(length=64)))
    op.add_column('tool_calls', sa.Column('effect_attempts', sa.Integer(), nullable=False, server_default='0'))
    op.add_column('tool_calls', sa.Column('step_attempts', sa.Integer(), nullable=False, server_default='0'))
    op.add_column('tool_calls', sa.Column('outcome', sa.String(length=12)))
    op.create_check_constraint('valid_outcome', 'tool_calls',
                               "outcome IS NULL OR outcome IN ('done', 'not_done', 'unconfirmed')")


def downgrade() -> None:
    op.drop_constraint('valid_outcome', 'tool_calls', type_='check')
    for column in ('outcome', 'step_attempts', 'effect_attempts', 'effect_claimed_by', 'effect_claimed_until'):
        op.drop_column('tool_calls', column)
