"""A side effect's claim names its holder's kernel boot, pid namespace and whole host name

``tool_calls.effect_claimed_by`` held the claiming attempt's token in 64 characters, enough for a
host named by the first 24 characters of its name. A token now names the kernel's boot id (36
characters), the pid namespace and the host's whole name (up to 64 characters on Linux), then the
process and a nonce: the column holds any length (``text``; from ``varchar`` PostgreSQL changes the
type without rewriting the table).

Revision ID: 0020
Revises: 0017
"""
from alembic import op
import sqlalchemy as sa

revision = '0020'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.alter_column('tool_calls', 'effect_claimed_by', type_=sa.Text(), existing_type=sa.String(length=64))


def downgrade() -> None:
    # a token longer than the old width (one of the newer release) is cut to it
    op.alter_column('tool_calls', 'effect_claimed_by', type_=sa.String(length=64), existing_type=sa.Text(),
                    postgresql_using='left(effect_claimed_by, 64)')
