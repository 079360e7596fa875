"""The console's reads: calls newest first by keyset, and a new call announced

``idx_tool_calls_created`` (every call by ``created_at, tool_call_id``),
``idx_tool_calls_caller_created`` (a caller's own, the fence of every non-admin list) and
``idx_tool_calls_tool_created`` (one tool's): the console pages its list of calls newest first
by keyset on ``(created_at, tool_call_id)`` (``models/browse.py``), never by OFFSET, so a page
costs the same at the ten-millionth call as at the first. Built ``CONCURRENTLY``, outside the
migration's transaction, so a large table keeps taking writes while they are built.

``tool_calls_created_notify``: a new call NOTIFYs channel ``tool_call_status`` with its
tool_call_id, as a change of status already does (migration 0001), so the console's live list
shows a call recorded through any door without polling (``app/console/live.py``).

Revision ID: 0021
Revises: 0020
"""
from alembic import op

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None

# what it is to the previous release's running processes (docs/operations.md, "Upgrading")
running_release = "safe"
running_release_why = "a trigger and indexes built concurrently: writes go on while they are built"

INDEXES = {
    'idx_tool_calls_created': ['created_at', 'tool_call_id'],
    'idx_tool_calls_caller_created': ['caller', 'created_at', 'tool_call_id'],
    'idx_tool_calls_tool_created': ['function_name', 'created_at', 'tool_call_id'],
}

CREATED_TRIGGER = """
CREATE TRIGGER tool_calls_created_notify
AFTER INSERT ON tool_calls
FOR EACH ROW EXECUTE FUNCTION notify_tool_call_status()
"""


def upgrade() -> None:
    op.execute(CREATED_TRIGGER)
    with op.get_context().autocommit_block():
        for name, columns in INDEXES.items():
            op.create_index(name, 'tool_calls', columns, postgresql_concurrently=True, if_not_exists=True)


def downgrade() -> None:
    """Keeps the data (indexes and a trigger only), dropping the indexes concurrently."""
    op.execute("DROP TRIGGER IF EXISTS tool_calls_created_notify ON tool_calls")
    with op.get_context().autocommit_block():
        for name in INDEXES:
            op.drop_index(name, table_name='tool_calls', postgresql_concurrently=True, if_exists=True)
