"""``GET /voice-tools/events/<session_id>``: the session's events as Server-Sent Events.

For relays that cannot expose a callback endpoint (CONTRACT section 11). The events
are the callback rows themselves (``callback_deliveries``, one source of truth; an
event with no callback URL is recorded too), each sent as::

    id: <event_id>
    data: <the callback body, JSON>

in a stable order: ``(xid, position)``, where ``xid`` is the transaction that recorded
the event, and a row is sent only once every older transaction has ended (see
migration 0007). So an event committed late never sorts before one a client already
has, and a client that reconnects with ``Last-Event-ID`` (the header, or the
``last_event_id`` query parameter for clients that cannot set headers) gets exactly
what it missed: no loss, no duplicate. A call's own events are also in ``seq`` order.

Waking: a trigger NOTIFYs channel ``voice_tools_events`` with the session id when an
event is recorded; one listener thread per process (:class:`Listener`, one database
connection) wakes the streams of that session. A stream borrows a pooled connection
only to read new rows and holds none while it waits; it writes a keep-alive comment
every ``KEEPALIVE_S`` seconds. Each open stream holds one gunicorn thread (README
"Event stream").
"""
from __future__ import annotations

import logging
import re
import select
import threading
import time
from typing import Any, Iterator

from flask import Blueprint, Response, g, request, stream_with_context
from marshmallow import Schema, fields
from sqlalchemy import text
from sqlalchemy.exc import InterfaceError, OperationalError

from app import inputs
from tasks.calls import schemas
from tasks.calls.errors import validation_error
from app.openapi import doc
from models import db

log = logging.getLogger(__name__)

bp = Blueprint("events", __name__)

CHANNEL = "voice_tools_events"
KEEPALIVE_S = 15.0
BATCH = 200
# an event committed while an older transaction is still open waits for it; look again this soon
UNSETTLED_RETRY_S = 0.05

_READ = text(f"""
    SELECT event_id, payload, xid::text AS xid, position,
           xid < pg_snapshot_xmin(pg_current_snapshot()) AS settled
    FROM callback_deliveries
    WHERE session_id = :session_id AND (xid, position) > (CAST(:xid AS xid8), :position)
      AND (CAST(:caller AS text) IS NULL OR EXISTS (
           SELECT 1 FROM tool_calls t WHERE t.tool_call_id = callback_deliveries.tool_call_id
                                        AND t.caller = CAST(:caller AS text)))
    ORDER BY xid, position
    LIMIT {BATCH}
""")
_CURSOR = text("""
    SELECT d.session_id, d.xid::text AS xid, d.position FROM callback_deliveries d
    JOIN tool_calls t ON t.tool_call_id = d.tool_call_id
    WHERE d.event_id = :event_id AND (CAST(:caller AS text) IS NULL OR t.caller = CAST(:caller AS text))
""")


class EventsQuery(Schema):
    last_event_id = fields.String(metadata={"description": "Resume after this event (or the Last-Event-ID header)"})

    class Meta:
        from marshmallow import RAISE

        unknown = RAISE


class Listener:
    """One LISTEN connection per process; wakes the streams of a session when it has news."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._reconnecting = False

    def subscribe(self, session_id: str) -> threading.Event:
        self._ensure_running()
        woken = threading.Event()
        with self._lock:
            self._waiters.setdefault(session_id, set()).add(woken)
        return woken

    def unsubscribe(self, session_id: str, woken: threading.Event) -> None:
        with self._lock:
            waiters = self._waiters.get(session_id)
            if waiters is not None:
                waiters.discard(woken)
                if not waiters:
                    del self._waiters[session_id]

    def _wake(self, session_id: str | None) -> None:
        with self._lock:
            targets = [w for s, ws in self._waiters.items() if session_id is None or s == session_id for w in ws]
        for woken in targets:
            woken.set()

    def _ensure_running(self) -> None:
        import os

        with self._lock:
            if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
                return
            self._pid = os.getpid()  # a forked gunicorn worker starts its own
            self._thread = threading.Thread(target=self._run, name="voice-tools-events", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._listen()
            except Exception as exc:  # the database went away: wake everyone (they re-read), then listen again
                if not self._reconnecting:  # said once per outage, not once a second
                    self._reconnecting = True
                    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    log.warning("event listener lost its database connection (%s); reconnecting", first_line)
                self._wake(None)
                time.sleep(1.0)

    def _listen(self) -> None:
        import psycopg2

        conn = psycopg2.connect(db.engine().url.render_as_string(hide_password=False).replace(
            "postgresql+psycopg2://", "postgresql://"))
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"LISTEN {CHANNEL}")
            self._reconnecting = False
            self._wake(None)  # anything recorded before the LISTEN is read by the woken streams
            while True:
                if select.select([conn], [], [], 60.0)[0]:
                    conn.poll()
                    sessions = {note.payload for note in conn.notifies}
                    conn.notifies.clear()
                    for session_id in sessions:
                        self._wake(session_id)
                else:
                    with conn.cursor() as cur:  # an idle check that the connection is alive
                        cur.execute("SELECT 1")
        finally:
            conn.close()


LISTENER = Listener()

# every event id is 32 lowercase hex digits (tasks/delivery/events.py: uuid4().hex)
EVENT_ID = re.compile(r"[0-9a-f]{32}")


def _cursor_after(session_id: str, last_event_id: str | None, caller: str | None = None) -> tuple[str, int]:
    """Where to start: after ``last_event_id`` (which must be one of the session's events, of the
    caller's calls when ``caller`` is given), or the beginning."""
    if not last_event_id:
        return "0", 0
    found = None
    if EVENT_ID.fullmatch(last_event_id):  # anything else names no event (and a NUL must not reach the driver)
        with db.engine().connect() as conn:
            found = conn.execute(_CURSOR, {"event_id": last_event_id, "caller": caller}).one_or_none()
    if found is None or found.session_id != session_id:
        raise validation_error({"last_event_id": [f"No event {last_event_id!r} in session {session_id}."]})
    return found.xid, found.position


def _frame(event_id: str, payload: dict[str, Any]) -> str:
    import json

    return f"id: {event_id}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def stream(session_id: str, xid: str, position: int, keepalive_s: float = KEEPALIVE_S,
           caller: str | None = None) -> Iterator[str]:
    """The session's events after ``(xid, position)``, then new ones as they are recorded, forever;
    only those of ``caller``'s calls when it is given (None: an operator's, every event)."""
    woken = LISTENER.subscribe(session_id)
    try:
        yield ": voice-tools event stream\n\n"
        while True:
            woken.clear()
            try:
                with db.engine().connect() as conn:  # borrowed for the read only
                    rows = conn.execute(_READ, {"session_id": session_id, "xid": xid, "position": position,
                                                "caller": caller}).all()
            except (OperationalError, InterfaceError):  # the database is away: end; the client resumes later
                log.warning("event stream of %s ended: database unavailable", session_id)
                return
            unsettled = False
            for row in rows:
                if not row.settled:  # an older transaction may still record an event that sorts first
                    unsettled = True
                    break
                xid, position = row.xid, row.position
                yield _frame(row.event_id, row.payload)
            if len(rows) == BATCH and not unsettled:
                continue
            if not woken.wait(UNSETTLED_RETRY_S if unsettled else keepalive_s) and not unsettled:
                yield ": keep-alive\n\n"
    finally:
        LISTENER.unsubscribe(session_id, woken)


@bp.get("/voice-tools/events/<session_id>")
@doc("The session's events as Server-Sent Events (resumable with Last-Event-ID)", query=EventsQuery,
     responses={200: ("text/event-stream", "`id: <event_id>` and `data: <the callback body>` per event",
                      {"type": "object", "required": ["data"],
                       "properties": {"id": {"type": "string"},
                                      "data": {"type": "string", "description": "The callback body (JSON)"}}})})
def events(session_id: str):
    session_id = inputs.load(schemas.SessionPath, {"session_id": session_id})["session_id"]
    query = inputs.load(EventsQuery, inputs.query())
    last = request.headers.get("Last-Event-ID") or query.get("last_event_id")
    scope = g.who.scope  # a caller sees the events of its own calls only; an admin, all of them
    xid, position = _cursor_after(session_id, last, scope)
    response = Response(stream_with_context(stream(session_id, xid, position, caller=scope)),
                        mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # no proxy buffering
    return response
