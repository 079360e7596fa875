"""LISTEN/NOTIFY, for both waits that must not poll: ``?wait=S`` (:func:`until_settled`) and the
session's event stream (:func:`session_events`, woken by one :class:`Listener` per process).

``?wait``: a trigger NOTIFYs channel ``tool_call_status`` with the tool_call_id on every
status change (migration 0001). We borrow a pooled connection, LISTEN, read the status
once (a change made before the LISTEN would otherwise be missed), then sleep in
``select()`` on the connection's socket until a notification for this call arrives or the
deadline passes; the connection goes back to the pool after ``UNLISTEN *``. An error of
that raw connection is wrapped as SQLAlchemy wraps any other (a lost server is an
``OperationalError``, answered 503 like every database outage).

The event stream: a trigger NOTIFYs channel ``voice_tools_events`` with the session id
when an event is recorded (migration 0007); one listener thread per process (one database
connection of its own) wakes the streams of that session. The events are the callback
rows themselves, read in ``commit_seq`` order: a number each row takes when its
transaction commits (migration 0012: a deferred constraint trigger takes a transaction-scoped
advisory lock of this database, then ``nextval``; the lock is released only after the
commit is visible). Why that order has no gap a reader can miss: two transactions that
number events hold the lock one after the other, so the one that took the smaller number
was visible before the other took its number; a reader whose snapshot sees event ``n``
therefore sees every committed event numbered below ``n``, and a number it never sees
belongs to a transaction that rolled back. Nothing else is waited for: a transaction
left open in this database or in any other of the server delays no stream. A reader that
resumes after an event gets exactly what it missed (no loss, no duplicate), and a call's
events are in ``seq`` order (the transition that records event ``k + 1`` waits on the
call's row until the one that recorded ``k`` committed). A stream borrows a pooled
connection only to read new rows, holds none while it waits, and reads again only when
NOTIFY wakes it or its keep-alive interval has passed.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Iterator

from sqlalchemy import Row, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from models import db, queries
from models.calls import PREPARED, TERMINAL, ToolCall

log = logging.getLogger(__name__)

SETTLED = (PREPARED, *TERMINAL)
STATUS_CHANNEL = "tool_call_status"
EVENTS_CHANNEL = "voice_tools_events"
BATCH = 200  # rows read at a time


# -- ?wait: until a call is PREPARED or terminal ---------------------------------------

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
            cur.execute(f"LISTEN {STATUS_CHANNEL}")
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


# -- the event stream: a session's events, as they are recorded --------------------------

_READ = text(f"""
    SELECT event_id, payload, commit_seq
    FROM callback_deliveries
    WHERE session_id = :session_id AND commit_seq > :after
      AND (CAST(:caller AS text) IS NULL OR EXISTS (
           SELECT 1 FROM tool_calls t WHERE t.tool_call_id = callback_deliveries.tool_call_id
                                        AND t.caller = CAST(:caller AS text)))
    ORDER BY commit_seq
    LIMIT {BATCH}
""")
_POSITION = text("""
    SELECT d.session_id, d.commit_seq FROM callback_deliveries d
    JOIN tool_calls t ON t.tool_call_id = d.tool_call_id
    WHERE d.event_id = :event_id AND (CAST(:caller AS text) IS NULL OR t.caller = CAST(:caller AS text))
""")


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
                cur.execute(f"LISTEN {EVENTS_CHANNEL}")
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


def event_position(event_id: str, caller: str | None = None) -> Row | None:
    """Where an event sorts in its session's stream: ``(session_id, commit_seq)``; None if there
    is no such event (of ``caller``'s calls, when given)."""
    with db.engine().connect() as conn:
        return conn.execute(_POSITION, {"event_id": event_id, "caller": caller}).one_or_none()


def session_events(session_id: str, after: int, keepalive_s: float,
                   caller: str | None = None) -> Iterator[Row | None]:
    """The session's events numbered after ``after``, then new ones as they are recorded, until the
    database is away; only those of ``caller``'s calls when it is given (None: every event).

    Each event is a row (``event_id``, ``payload``, ``commit_seq``); None when ``keepalive_s``
    seconds passed with nothing new. No connection is held between reads, and nothing is
    read again until NOTIFY wakes the stream or ``keepalive_s`` has passed.
    """
    woken = LISTENER.subscribe(session_id)
    try:
        while True:
            woken.clear()
            try:
                with db.engine().connect() as conn:  # borrowed for the read only
                    rows = conn.execute(_READ, {"session_id": session_id, "after": after, "caller": caller}).all()
            except (OperationalError, InterfaceError):  # the database is away: end; the reader resumes later
                log.warning("event stream of %s ended: database unavailable", session_id)
                return
            for row in rows:
                after = row.commit_seq
                yield row
            if len(rows) == BATCH:
                continue
            if not woken.wait(keepalive_s):
                yield None
    finally:
        LISTENER.unsubscribe(session_id, woken)
