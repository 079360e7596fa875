"""What the retention purge removes, one small batch per transaction (``tasks.calls.maintenance.purge``).

- **Ended calls** (COMPLETED, FAILED, CANCELLED, EXPIRED) whose ``completed_at`` is older than the
  calls' retention, with every event (``callback_deliveries`` row) of theirs; a call with an event
  still pending (a callback being retried) is kept until that event is settled.
- **Settled events** (delivered, failed, or ``none``: no URL took them) of ended calls, older
  than the events' retention, whose call is kept longer.
- **Expired session context** (past its ``expires_at``).

An open call (PENDING, MODIFIED, EXECUTING, PREPARED) and a pending event are never removed. A
batch locks only the rows it removes, and skips rows another transaction holds (``SKIP LOCKED``):
the next batch or the next sweep takes them. A batch's rows are picked once, in a ``MATERIALIZED``
CTE: a ``DELETE … WHERE id IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)`` may be planned as a
nested loop that runs the pick again for each row (as PostgreSQL does when a table's statistics
say it is small), and each run skips the rows the statement has just removed and picks the next:
one batch would then remove them all. Each batch is picked through a partial index
(``idx_tool_calls_ended``, ``idx_callback_settled``, ``idx_session_context_expires``), so a batch
costs the same on a table of ten million rows as on one of a thousand.

Why events are removed before their call (and not by the foreign key's cascade alone): an event
set back to pending (``callbacks redeliver``) while the batch runs is then kept, since the
``DELETE … AND state <> 'pending'`` re-reads a row another transaction changed, and the call
with it, since a call is removed only once none of its events is left.
"""
from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

ENDED = "('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')"

_OLD_CALLS = f"""
FROM tool_calls c
WHERE c.status IN {ENDED} AND c.completed_at < now() - make_interval(secs => :age)
  AND NOT EXISTS (SELECT 1 FROM callback_deliveries d WHERE d.tool_call_id = c.tool_call_id AND d.state = 'pending')
"""

_PICK_CALLS = text(f"SELECT c.tool_call_id {_OLD_CALLS} ORDER BY c.completed_at LIMIT :n FOR UPDATE OF c SKIP LOCKED")
_DELETE_THEIR_EVENTS = text("DELETE FROM callback_deliveries WHERE tool_call_id = ANY(:ids) AND state <> 'pending'")
_DELETE_CALLS = text("""
DELETE FROM tool_calls c WHERE c.tool_call_id = ANY(:ids)
  AND NOT EXISTS (SELECT 1 FROM callback_deliveries d WHERE d.tool_call_id = c.tool_call_id)
""")

_OLD_EVENTS = f"""
FROM callback_deliveries d JOIN tool_calls c ON c.tool_call_id = d.tool_call_id
WHERE d.state <> 'pending' AND d.created_at < now() - make_interval(secs => :age) AND c.status IN {ENDED}
"""
_DELETE_EVENTS = text(f"""
WITH picked AS MATERIALIZED (SELECT d.id {_OLD_EVENTS} ORDER BY d.created_at LIMIT :n FOR UPDATE OF d SKIP LOCKED)
DELETE FROM callback_deliveries e USING picked WHERE e.id = picked.id AND e.state <> 'pending'
""")

_EXPIRED_CONTEXT = "FROM session_context WHERE expires_at <= now()"
_DELETE_CONTEXT = text(f"""
WITH picked AS MATERIALIZED (SELECT id {_EXPIRED_CONTEXT} ORDER BY expires_at LIMIT :n FOR UPDATE SKIP LOCKED)
DELETE FROM session_context x USING picked WHERE x.id = picked.id AND x.expires_at <= now()
""")


def purge_calls(s: Session, older_than_s: float, limit: int) -> tuple[int, int, int]:
    """One batch: up to ``limit`` ended calls older than ``older_than_s`` seconds, and their events.
    Returns (calls removed, their events removed, calls picked)."""
    ids = list(s.scalars(_PICK_CALLS, {"age": float(older_than_s), "n": int(limit)}))
    if not ids:
        return 0, 0, 0
    events = s.execute(_DELETE_THEIR_EVENTS, {"ids": ids}).rowcount or 0
    calls = s.execute(_DELETE_CALLS, {"ids": ids}).rowcount or 0
    return calls, events, len(ids)


def purge_events(s: Session, older_than_s: float, limit: int) -> int:
    """One batch: up to ``limit`` settled events of ended calls older than ``older_than_s`` seconds."""
    return s.execute(_DELETE_EVENTS, {"age": float(older_than_s), "n": int(limit)}).rowcount or 0


def purge_context(s: Session, limit: int) -> int:
    """One batch: up to ``limit`` session context values past their expiry."""
    return s.execute(_DELETE_CONTEXT, {"n": int(limit)}).rowcount or 0


def count_calls(s: Session, older_than_s: float) -> tuple[int, int]:
    """What :func:`purge_calls` would remove now: (calls, their events)."""
    row = s.execute(text(f"""
        SELECT count(*), coalesce(sum((SELECT count(*) FROM callback_deliveries e
                                       WHERE e.tool_call_id = c.tool_call_id)), 0)
        {_OLD_CALLS}"""), {"age": float(older_than_s)}).one()
    return int(row[0]), int(row[1])


def count_events(s: Session, older_than_s: float, calls_older_than_s: float | None = None) -> int:
    """What :func:`purge_events` would remove now; with ``calls_older_than_s``, after
    :func:`purge_calls` removed the calls older than that (and their events)."""
    kept = "" if calls_older_than_s is None else (
        " AND c.tool_call_id NOT IN (SELECT c.tool_call_id "
        + _OLD_CALLS.replace(":age", ":calls_age") + ")")
    return int(s.execute(text(f"SELECT count(*) {_OLD_EVENTS}{kept}"),
                         {"age": float(older_than_s), "calls_age": float(calls_older_than_s or 0)}).scalar_one())


def count_context(s: Session) -> int:
    """Session context values past their expiry."""
    return int(s.execute(text(f"SELECT count(*) {_EXPIRED_CONTEXT}")).scalar_one())
