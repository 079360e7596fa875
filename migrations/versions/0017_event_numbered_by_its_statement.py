"""An event recorded by a statement that is its own transaction is numbered by that statement

The stream's order (``callback_deliveries.commit_seq``) is taken under a transaction-scoped
advisory lock that is released only once the commit is visible (migration 0012). A transaction
of several statements takes it at its commit, in the deferred trigger, which then has to update
the row it inserted: a second version of the row, and an entry in each of the table's indexes
again. A link's statements are each their own transaction (autocommit): the commit follows the
statement at once, so the statement can take the lock and the number itself, in its INSERT
(``voice_tools_event_number()``), with the same guarantee, and the row is written once. The
trigger then only sends the notification (still under the lock, which the transaction holds).

Revision ID: 0017
Revises: 0016
"""
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

ORDER_LOCK = "hashtextextended('voice_tools.event_commit_order', 0)"
NOTICE_BYTES = 7900  # PostgreSQL refuses a notification payload of 8000 bytes or more

NUMBER_NOW = f"""
CREATE FUNCTION voice_tools_event_number() RETURNS bigint AS $$
BEGIN
    PERFORM pg_advisory_xact_lock({ORDER_LOCK});
    RETURN nextval('callback_deliveries_commit_seq');
END;
$$ LANGUAGE plpgsql VOLATILE
"""


def _number_and_notify(numbered_by_statement: bool) -> str:
    numbered = """
    IF NEW.commit_seq IS NOT NULL THEN  -- numbered by its statement, which holds the lock until its commit
        n := NEW.commit_seq;
        row_now := NEW;
    ELSE""" if numbered_by_statement else ""
    end = "\n    END IF;" if numbered_by_statement else ""
    return f"""
CREATE OR REPLACE FUNCTION number_voice_tools_event() RETURNS trigger AS $$
DECLARE
    n bigint;
    row_now record;
    notice text;
BEGIN{numbered}
    PERFORM pg_advisory_xact_lock({ORDER_LOCK});
    n := nextval('callback_deliveries_commit_seq');
    UPDATE callback_deliveries SET commit_seq = n WHERE id = NEW.id
        RETURNING session_id, event_id, tool_call_id, payload INTO row_now;
    IF NOT FOUND THEN  -- deleted by its own transaction: nothing to announce
        RETURN NULL;
    END IF;{end}
    notice := json_build_object(
        'session_id', row_now.session_id, 'commit_seq', n, 'event_id', row_now.event_id,
        'caller', (SELECT caller FROM tool_calls WHERE tool_call_id = row_now.tool_call_id),
        'payload', row_now.payload)::text;
    IF octet_length(notice) > {NOTICE_BYTES} THEN
        notice := json_build_object('session_id', row_now.session_id, 'commit_seq', n)::text;
    END IF;
    PERFORM pg_notify('voice_tools_events', notice);
    RETURN NULL;
END;
$$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    op.execute(NUMBER_NOW)
    op.execute(_number_and_notify(numbered_by_statement=True))


def downgrade() -> None:
    op.execute(_number_and_notify(numbered_by_statement=False))  # 0015's
    op.execute("DROP FUNCTION voice_tools_event_number()")
