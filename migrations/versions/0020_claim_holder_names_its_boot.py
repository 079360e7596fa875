"""A side effect's claim names its holder's kernel boot, pid namespace and whole host name

``tool_calls.effect_claimed_by`` held the claiming attempt's token in 64 characters, enough for a
host named by the first 24 characters of its name. A token now names the kernel's boot id (36
characters), the pid namespace and the host's whole name (up to 64 characters on Linux), then the
process and a nonce: the column holds any length (``text``; from ``varchar`` PostgreSQL changes the
type without rewriting the table).

Revision ID: 0020
Revises: 0018
"""
from alembic import op
import sqlalchemy as sa

revision = '0020'
down_revision = '0018'
branch_labels = None
depends_on = None

# what it is to the previous release's running processes (docs/operations.md, "Upgrading")
running_release = "restart"
running_release_why = "changes the type of a column the previous release's prepared statements return: PostgreSQL refuses their plans (0.1.0's processes do not prepare them again): restart them right after it"


def upgrade() -> None:
    op.alter_column('tool_calls', 'effect_claimed_by', type_=sa.Text(), existing_type=sa.String(length=64))


def downgrade() -> None:
    """Keeps the data: the column stays ``text`` (the release before reads and writes it as it did its
    ``varchar(64)``). Narrowing it back would cut the newer tokens and change, under the running processes,
    the type their statements return."""
