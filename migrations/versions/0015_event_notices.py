"""An event's notification carries the event

The deferred trigger that numbers an event at its commit (``number_voice_tools_event``,
migration 0012) now also NOTIFYs channel ``voice_tools_events`` with the event itself, as
JSON: ``session_id``, ``commit_seq``, ``event_id``, the call's ``caller`` and the callback
``payload``. A stream that is caught up writes it as it arrives, with no read of the table
(``models/listen.py``). When the JSON would not fit a notification (PostgreSQL takes less
than 8000 bytes), it carries ``session_id`` and ``commit_seq`` only and the stream reads the
row. The notifications leave in number order: the trigger sends its notification while it
holds the lock that orders the numbers, and PostgreSQL queues a transaction's notifications
before that lock is released, after every deferred trigger has run.

The insert trigger of migration 0007, which sent the bare session id, is dropped.

Revision ID: 0015
Revises: 0014
"""
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

ORDER_LOCK = "hashtextextended('voice_tools.event_commit_order', 0)"
NOTICE_BYTES = 7900  # PostgreSQL refuses a notification payload of 8000 bytes or more

NUMBER_AND_NOTIFY = f"""
CREATE OR REPLACE FUNCTION number_voice_tools_event() RETURNS trigger AS $$
DECLARE
    n bigint;
    row_now record;
    notice text;
BEGIN
    PERFORM pg_advisory_xact_lock({ORDER_LOCK});
    n := nextval('callback_deliveries_commit_seq');
    UPDATE callback_deliveries SET commit_seq = n WHERE id = NEW.id
        RETURNING session_id, event_id, tool_call_id, payload INTO row_now;
    IF NOT FOUND THEN  -- deleted by its own transaction: nothing to announce
        RETURN NULL;
    END IF;
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

NUMBER_ONLY = f"""
CREATE OR REPLACE FUNCTION number_voice_tools_event() RETURNS trigger AS $$
BEGIN
    PERFORM pg_advisory_xact_lock({ORDER_LOCK});
    UPDATE callback_deliveries SET commit_seq = nextval('callback_deliveries_commit_seq') WHERE id = NEW.id;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql
"""

SESSION_NOTIFY = """
CREATE FUNCTION notify_voice_tools_event() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('voice_tools_events', NEW.session_id);
    RETURN NEW;
END;
$$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    op.execute("DROP TRIGGER callback_deliveries_notify ON callback_deliveries")
    op.execute("DROP FUNCTION notify_voice_tools_event()")
    op.execute(NUMBER_AND_NOTIFY)


def downgrade() -> None:
    op.execute(NUMBER_ONLY)
    op.execute(SESSION_NOTIFY)
    op.execute("CREATE TRIGGER callback_deliveries_notify AFTER INSERT ON callback_deliveries "
               "FOR EACH ROW EXECUTE FUNCTION notify_voice_tools_event()")
