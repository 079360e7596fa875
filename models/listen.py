"""LISTEN/NOTIFY, for both waits that must not poll: ``?wait=S`` (:func:`until_settled`) and the
session's event stream (:func:`session_events_async`, woken by one :class:`Listener` per process).

``?wait``: a trigger NOTIFYs channel ``tool_call_status`` with the tool_call_id on every
status change (migration 0001). The process's one listener (below) wakes the waits on that
call; a wait subscribes, then reads the status (a change made before it subscribed is read,
one made after wakes it), and reads again only when woken. It borrows a pooled connection for
each read and holds none while it waits; a database lost meanwhile wakes it, and its next read
fails as any other (an ``OperationalError``, answered 503 like every database outage).

The event stream: a trigger NOTIFYs channel ``voice_tools_events`` with the session id
when an event is recorded (migration 0007); the same listener thread (one database connection
of its own per process, to ``DATABASE_LISTEN_URL``: PostgreSQL itself when ``DATABASE_URL`` names a
pooler in transaction mode) wakes the streams of that session. The events are the callback
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
connection only to read new rows and holds none while it waits. The same reads serve an
asyncio task (:func:`session_events_async`, the API's streams: ``app/stream_loop.py``), which
waits on its loop, reads in the loop's executor only when woken (by NOTIFY, or by the listener's
reconnection, which wakes everyone) and shares one read with the streams of its session woken
with it; and a thread (:func:`session_events`, a stream a server gave no socket for), which
reads again when woken or when its keep-alive interval has passed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import selectors
import threading
import time
from typing import Any, AsyncIterator, Iterator, Protocol

from sqlalchemy import Row, text
from sqlalchemy.exc import InterfaceError, OperationalError

from models import db, queries
from models.calls import PREPARED, TERMINAL, ToolCall

log = logging.getLogger(__name__)

SETTLED = (PREPARED, *TERMINAL)
STATUS_CHANNEL = "tool_call_status"
EVENTS_CHANNEL = "voice_tools_events"
BATCH = 200  # rows read at a time


# -- ?wait: until a call is PREPARED or terminal ---------------------------------------

_STATUS = text("SELECT status FROM tool_calls WHERE tool_call_id = :id")


def until_settled(tool_call_id: str, timeout: float) -> tuple[ToolCall, bool]:
    """``(call, settled)``: the call once PREPARED or terminal, or as it is at the deadline.

    Woken by the process's :data:`LISTENER` (subscribed before the first read, so a change made
    before it is read, and one made after wakes it); a pooled connection is borrowed only for each
    read of the status, none is held while waiting. A database that goes away while it waits wakes
    it, and the next read raises as any other (503)."""
    deadline = time.monotonic() + timeout
    woken = LISTENER.subscribe(tool_call_id, STATUS_CHANNEL)
    try:
        while True:
            woken.clear()
            with db.engine().connect() as conn:
                status = conn.execute(_STATUS, {"id": tool_call_id}).scalar_one_or_none()
            if status in SETTLED or status is None:
                break
            left = deadline - time.monotonic()
            if left <= 0 or not woken.wait(left):
                break
    finally:
        LISTENER.unsubscribe(tool_call_id, woken, STATUS_CHANNEL)
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


class Waker(Protocol):
    def set(self) -> None: ...


class LoopEvent:
    """An :class:`asyncio.Event` of ``loop`` that the listener's thread can set."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    def set(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


class Listener:
    """One LISTEN connection per process, on both channels; wakes the streams of a session when it has
    news, and the waits on a call when its status changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[tuple[str, str], set[Waker]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._reconnecting = False

    def subscribe(self, key: str, channel: str = EVENTS_CHANNEL) -> threading.Event:
        """An event set when ``channel`` notifies ``key`` (a session id on the events channel, a
        tool_call_id on the status channel), or when the listener (re)connects."""
        woken = threading.Event()
        self.add(key, woken, channel)
        return woken

    def subscribe_loop(self, key: str, loop: asyncio.AbstractEventLoop,
                       channel: str = EVENTS_CHANNEL) -> LoopEvent:
        """As :meth:`subscribe`, for a task of ``loop``: its ``event`` is set on the loop."""
        woken = LoopEvent(loop)
        self.add(key, woken, channel)
        return woken

    def add(self, key: str, woken: Waker, channel: str = EVENTS_CHANNEL) -> None:
        self._ensure_running()
        with self._lock:
            self._waiters.setdefault((channel, key), set()).add(woken)

    def unsubscribe(self, key: str, woken: Waker, channel: str = EVENTS_CHANNEL) -> None:
        with self._lock:
            waiters = self._waiters.get((channel, key))
            if waiters is not None:
                waiters.discard(woken)
                if not waiters:
                    del self._waiters[(channel, key)]

    def _wake(self, target: tuple[str, str] | None) -> None:
        with self._lock:
            if target is None:
                woken = [w for ws in self._waiters.values() for w in ws]
            else:
                woken = list(self._waiters.get(target, ()))
        for event in woken:
            event.set()

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

        conn = psycopg2.connect(db.listen_url())  # direct: LISTEN cannot pass a transaction-mode pooler
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"LISTEN {EVENTS_CHANNEL}; LISTEN {STATUS_CHANNEL}")
            self._reconnecting = False
            self._wake(None)  # anything before the LISTEN is read by the woken streams and waits
            with selectors.DefaultSelector() as ready:  # epoll: select() takes no descriptor past 1024
                ready.register(conn, selectors.EVENT_READ)
                while True:
                    if ready.select(60.0):
                        conn.poll()
                        news = {(note.channel, note.payload) for note in conn.notifies}
                        conn.notifies.clear()
                        for target in news:
                            self._wake(target)
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


def read_events(session_id: str, after: int, caller: str | None = None) -> list[Row]:
    """Up to :data:`BATCH` of the session's events numbered after ``after`` (of ``caller``'s calls when
    given), in order; a pooled connection is borrowed for the read only."""
    with db.engine().connect() as conn:
        return conn.execute(_READ, {"session_id": session_id, "after": after, "caller": caller}).all()


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
                rows = read_events(session_id, after, caller)
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


async def session_events_async(session_id: str, after: int, keepalive_s: float,
                               caller: str | None = None) -> AsyncIterator[Row | None]:
    """:func:`session_events` for an asyncio task: the same rows in the same order, the same keep-alive
    Nones; it waits on its loop (no thread) and reads in the loop's default executor only when woken: by
    NOTIFY, or by the listener's (re)connection, which wakes every stream. A keep-alive reads nothing, so
    a thousand idle streams do not read a thousand times every interval; the streams of one session woken
    together read once (:func:`_read_soon`)."""
    loop = asyncio.get_running_loop()
    woken = LISTENER.subscribe_loop(session_id, loop)
    try:
        while True:
            woken.event.clear()  # on the loop, as the listener's set: a wake during the read is kept
            try:
                rows = await asyncio.shield(_read_soon(loop, session_id, after, caller))
            except (OperationalError, InterfaceError):
                log.warning("event stream of %s ended: database unavailable", session_id)
                return
            for row in rows:
                after = row.commit_seq
                yield row
            if len(rows) == BATCH:
                continue
            while True:
                try:
                    await asyncio.wait_for(woken.event.wait(), keepalive_s)
                    break
                except TimeoutError:
                    yield None
    finally:
        LISTENER.unsubscribe(session_id, woken)


_joinable: dict[tuple[Any, ...], asyncio.Future] = {}


def _read_soon(loop: asyncio.AbstractEventLoop, session_id: str, after: int,
               caller: str | None) -> asyncio.Future:
    """:func:`read_events` in ``loop``'s executor, started at the loop's next turn and shared by every
    stream that asks for the same read before then: each asked after its wake was cleared, so the one
    read, begun after all of them asked, sees what woke each of them."""
    key = (loop, session_id, after, caller)
    future = _joinable.get(key)
    if future is None:
        future = _joinable[key] = loop.create_future()

        def start() -> None:
            del _joinable[key]
            job = loop.run_in_executor(None, read_events, session_id, after, caller)
            job.add_done_callback(lambda done: future.cancel() if done.cancelled() else (
                future.set_exception(done.exception()) if done.exception() else future.set_result(done.result())))

        loop.call_soon(start)
    return future
