"""``?wait=S``: answer when a call reaches PREPARED or a terminal status, without polling.

A trigger NOTIFYs channel ``tool_call_status`` with the tool_call_id on every status
change (migration 0001). We borrow a pooled connection, LISTEN, read the status once
(a change made before the LISTEN would otherwise be missed), then sleep in
``select()`` on the connection's socket until a notification for this call arrives or
the deadline passes; the connection goes back to the pool after ``UNLISTEN *``. An
error of that raw connection is wrapped as SQLAlchemy wraps any other (a lost server is
an ``OperationalError``, answered 503 like every database outage).
"""
from __future__ import annotations

import select
import time

from sqlalchemy.exc import DBAPIError

from models import db, queries
from models.calls import PREPARED, TERMINAL, ToolCall

SETTLED = (PREPARED, *TERMINAL)
CHANNEL = "tool_call_status"


def _status(conn, tool_call_id: str) -> str | None:
    with conn.cursor() as cur:
        cur.execute("SELECT status FROM tool_calls WHERE tool_call_id = %s", (tool_call_id,))
        found = cur.fetchone()
    return found[0] if found else None


def until_settled(tool_call_id: str, timeout: float) -> tuple[ToolCall, bool]:
    """``(call, settled)``: the call once PREPARED or terminal, or as it is at the deadline."""
    deadline = time.monotonic() + timeout
    proxy = db.engine().raw_connection()
    conn = proxy.dbapi_connection
    try:
        conn.rollback()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"LISTEN {CHANNEL}")
        status = _status(conn, tool_call_id)
        while status not in SETTLED and status is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([conn], [], [], left)[0]:
                break
            conn.poll()
            mine = any(note.payload == tool_call_id for note in conn.notifies)
            conn.notifies.clear()
            if mine:
                status = _status(conn, tool_call_id)
        with conn.cursor() as cur:  # back to the pool as it came: listening to nothing
            cur.execute("UNLISTEN *")
        conn.notifies.clear()
        conn.autocommit = False
    except Exception as exc:
        proxy.invalidate()  # never hand a half-listening connection to someone else
        dbapi = db.engine().dialect.loaded_dbapi
        if isinstance(exc, dbapi.Error):
            raise DBAPIError.instance(None, None, exc, dbapi.Error, connection_invalidated=True) from exc
        raise
    finally:
        proxy.close()
    with db.session() as s:
        call = queries.get(s, tool_call_id)
    return call, call.status in SETTLED
