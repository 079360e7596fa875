"""Each run of a call's links, kept on the call: ``tool_calls.link_attempts``

A JSON array of the call's latest link runs (at most ``models.link_attempts.KEPT``, oldest dropped
first), each ``{"step", "started_at", "took_ms", "outcome", "reason"}``: when the run began, how
long it took up to its record (the figure the workers' ``voice_tools_step_duration_seconds``
observes), ``done``, ``retried`` or ``failed``, and for a retried or failed run its error's class
and a short message (never parameters or secrets). Written by the statement each run already
makes (its record, its retry's count, its failure): no statement is added to a link. The
console's call page shows them, its tools view reads each step's p50 / p99 from them.

A column with a constant default: PostgreSQL adds it without rewriting the table.

Revision ID: 0022
Revises: 0021
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None

# what it is to the previous release's running processes (docs/operations.md, "Upgrading")
running_release = "safe"
running_release_why = "a column with a constant default, added without a rewrite: the previous release neither reads nor writes it"


def upgrade() -> None:
    op.add_column('tool_calls', sa.Column('link_attempts', postgresql.JSONB(astext_type=sa.Text()),
                                          server_default=sa.text("'[]'::jsonb"), nullable=False), if_not_exists=True)


def downgrade() -> None:
    """Keeps the data: the column stays (the release before never reads it, and its inserts take the
    default); upgraded again, the runs kept are shown again."""
