"""LISTEN/NOTIFY, for the waits that must not poll: ``?wait=S`` (:func:`until_settled`), the
session's event stream (:func:`session_events_async`) and the console's live list
(:func:`calls_changed`), all woken by one :class:`Listener` per process.

``?wait``: a trigger NOTIFYs channel ``tool_call_status`` with the tool_call_id on every
status change (migration 0001). The process's one listener (below) wakes the waits on that
call; a wait subscribes, then reads the status (a change made before it subscribed is read,
one made after wakes it), and reads again only when woken. It borrows a pooled connection for
each read and holds none while it waits; a database lost meanwhile wakes it, and its next read
fails as any other (an ``OperationalError``, answered 503 like every database outage).

The event stream: the events are the callback rows themselves, in ``commit_seq`` order: a
number each row takes when its transaction commits (migration 0012: a deferred constraint
trigger takes a transaction-scoped advisory lock of this database, then ``nextval``; the lock
is released only after the commit is visible). A statement that is its own transaction (a
link's, in autocommit) takes the lock and the number itself, in the INSERT of its event
(migration 0017): its commit follows at once, so the lock is held as long, and the row is
written once instead of twice. Why that order has no gap a reader can miss:
two transactions that number events hold the lock one after the other, so the one that took
the smaller number was visible before the other took its number; a reader whose snapshot sees
event ``n`` therefore sees every committed event numbered below ``n``, and a number it never
sees belongs to a transaction that rolled back. Nothing else is waited for: a transaction
left open in this database or in any other of the server delays no stream. A reader that
resumes after an event gets exactly what it missed (no loss, no duplicate), and a call's
events are in ``seq`` order (the transition that records event ``k + 1`` waits on the
call's row until the one that recorded ``k`` committed).

The same trigger NOTIFYs channel ``voice_tools_events`` with the event itself (migration
0015: a :class:`Notice`, its session, number, caller and payload; only the session and number
when the event is too large for a notification), while it holds that lock: the notifications
reach a listener in number order. One listener per process (:class:`Listener`: a thread whose
asyncio loop holds one database connection of its own, to ``DATABASE_LISTEN_URL``: PostgreSQL
itself when ``DATABASE_URL`` names a pooler in transaction mode) hands each notice to the streams
of its session; the same loop serves the API's streams, so a notice reaches a stream's socket with
no hop between threads.

An asyncio stream (:func:`session_events_async`, the API's streams: ``app/stream_loop.py``)
reads the table once when it starts, then writes each notice as it arrives, with no read: it
subscribed before that read, so every event the read did not see reaches it as a notice, in
order, and a notice it has already read is skipped by its number. A stream that waits with
nothing in its inbox is written to by the listener itself, in the callback that read the
notification (its ``direct`` writer): the streams of a session get an event one after the other
in one turn of the loop, without a task woken for each. It reads again only when a
notice has no payload, when its inbox overflows (a client slower than its events), and when the
listener (re)connects (notices may have been lost meanwhile), each time from its own last
number; the streams of one session that read together share one read, in the loop's executor.
It holds no connection while it waits. The console's live list (:func:`calls_changed`) is told the
tool_call_id of every call recorded (migration 0021: an INSERT notifies the status channel too),
changing status or recording an event, gathered for a moment; it reads the rows itself. A thread (:func:`session_events`, a stream a server gave
no socket for) reads the table each time it is woken, or when its keep-alive interval has passed.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Protocol

from sqlalchemy import Row, text
from sqlalchemy.exc import InterfaceError, OperationalError

from models import db, queries
from models.calls import PREPARED, TERMINAL, ToolCall

log = logging.getLogger(__name__)

SETTLED = (PREPARED, *TERMINAL)
STATUS_CHANNEL = "tool_call_status"
EVENTS_CHANNEL = "voice_tools_events"
BATCH = 200  # rows read at a time
READERS = 2  # threads (and so pooled connections at most) that read new rows for all of a process's streams
IDLE_CHECK_S = 60.0  # the listening connection, silent this long, is asked a SELECT 1


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


def _status_of(tool_call_id: str) -> str | None:
    with db.engine().connect() as conn:
        return conn.execute(_STATUS, {"id": tool_call_id}).scalar_one_or_none()


def _call_of(tool_call_id: str) -> ToolCall:
    with db.session() as s:
        return queries.get(s, tool_call_id)


async def until_settled_async(tool_call_id: str, timeout: float) -> tuple[ToolCall, bool]:
    """:func:`until_settled` for an asyncio task on the listener's loop (``app/stream_loop.py``; another loop
    awaits it there): the same answer, woken the same way, holding no thread while it waits (each read in
    the loop's executor)."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    woken = LISTENER.subscribe_loop(tool_call_id, loop, STATUS_CHANNEL)
    try:
        while True:
            woken.event.clear()
            woken.inbox.clear()
            status = await loop.run_in_executor(None, _status_of, tool_call_id)
            if status in SETTLED or status is None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                async with asyncio.timeout(left):
                    await woken.event.wait()
            except TimeoutError:
                break
    finally:
        LISTENER.unsubscribe(tool_call_id, woken, STATUS_CHANNEL)
    call = await loop.run_in_executor(None, _call_of, tool_call_id)
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


@dataclass(frozen=True)
class Notice:
    """An event as its NOTIFY carries it (migration 0015); ``payload`` None when it was too large to carry,
    ``commit_seq`` None when the notification said only the session (one sent before that migration)."""

    session_id: str
    commit_seq: int | None
    event_id: str | None = None
    caller: str | None = None
    payload: dict[str, Any] | None = None


def notice_of(text_: str) -> Notice:
    """The :class:`Notice` of a ``voice_tools_events`` notification's text."""
    if not text_.startswith("{"):
        return Notice(text_, None)
    body = json.loads(text_)
    return Notice(body["session_id"], body["commit_seq"], body.get("event_id"), body.get("caller"),
                  body.get("payload"))


class Waker(Protocol):
    def set(self) -> None: ...


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


READ = object()  # in a stream's inbox: read the table after the stream's last number
INBOX = BATCH  # notices a stream keeps before it drops them and reads the table instead


class LoopEvent:
    """A stream's inbox on ``loop``, filled by the listener's thread: notices of its session in their order,
    and :data:`READ` when it must read the table (first, and after the listener reconnected); ``event`` is
    set on the loop when something came in."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.inbox: deque[Any] = deque([READ])
        self.waiting = False  # its stream waits on ``event`` (it is not reading, nor writing)
        self.direct: Callable[[Notice], bool] | None = None  # takes a notice at once, if it can (True)

    def set(self) -> None:
        self._send(READ)

    def take(self, notice: Notice) -> None:
        if self.direct is not None and self.waiting and not self.inbox and notice.payload is not None \
                and notice.commit_seq is not None and _running_loop() is self.loop:
            try:
                if self.direct(notice):
                    return
            except Exception:  # the stream's own task meets the same trouble and ends the stream
                log.debug("a notice not written at once", exc_info=True)
        self._send(notice)

    def _send(self, item: Any) -> None:
        try:
            if _running_loop() is self.loop:  # the listener's own loop: no hop
                self._put(item)
            else:
                self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _put(self, item: Any) -> None:
        if len(self.inbox) >= INBOX:  # a slow reader: what it has not taken is read from the table
            self.inbox.clear()
            item = READ
        self.inbox.append(item)
        self.event.set()


class Heard:
    """A firehose's inbox on ``loop`` (:meth:`Listener.add_everything`): the ids of the calls that changed
    since it was last emptied, and ``reread`` when the listener (re)connected (notices may have been lost);
    ``event`` is set on the loop when something came in."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.ids: set[str] = set()
        self.reread = False

    def set(self) -> None:
        self._send(None)

    def take_ids(self, tool_call_ids: list[str]) -> None:
        self._send(tool_call_ids)

    def _send(self, ids: list[str] | None) -> None:
        try:
            if _running_loop() is self.loop:
                self._put(ids)
            else:
                self.loop.call_soon_threadsafe(self._put, ids)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _put(self, ids: list[str] | None) -> None:
        if ids is None or len(self.ids) + len(ids) > INBOX:  # too many to name: the reader reads its list again
            self.reread = True
            self.ids.clear()
        else:
            self.ids.update(ids)
        self.event.set()

    def drain(self) -> tuple[set[str], bool]:
        """``(ids, reread)`` come in so far, and empty again."""
        ids, reread = self.ids, self.reread
        self.ids, self.reread = set(), False
        self.event.clear()
        return ids, reread


async def calls_changed(keepalive_s: float, gather_s: float) -> AsyncIterator[tuple[set[str], bool] | None]:
    """Every call's changes, for an asyncio task: ``(tool_call_ids, reread)`` gathered over ``gather_s``
    after the first (``reread``: notices may have been missed, read everything again), None when
    ``keepalive_s`` passed with nothing; first a ``(set(), True)`` once subscribed, so the reader reads
    after it listens. Holds no connection."""
    heard = Heard(asyncio.get_running_loop())
    LISTENER.add_everything(heard)
    try:
        yield set(), True
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    await heard.event.wait()
            except TimeoutError:
                yield None
                continue
            await asyncio.sleep(gather_s)
            yield heard.drain()
    finally:
        LISTENER.remove_everything(heard)


class Listener:
    """One LISTEN connection per process, on both channels; wakes the streams of a session when it has
    news, and the waits on a call when its status changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[tuple[str, str], set[Waker]] = {}
        self._everything: set[Heard] = set()  # the firehoses: every call's changes (add_everything)
        self._loop: asyncio.AbstractEventLoop | None = None
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
        """As :meth:`subscribe`, for a stream served by ``loop``: its inbox (:class:`LoopEvent`) takes the
        session's notices, and its ``event`` is set on the loop."""
        woken = LoopEvent(loop)
        self.add(key, woken, channel)
        return woken

    def add(self, key: str, woken: Waker, channel: str = EVENTS_CHANNEL) -> None:
        self.loop()
        with self._lock:
            self._waiters.setdefault((channel, key), set()).add(woken)

    def unsubscribe(self, key: str, woken: Waker, channel: str = EVENTS_CHANNEL) -> None:
        with self._lock:
            waiters = self._waiters.get((channel, key))
            if waiters is not None:
                waiters.discard(woken)
                if not waiters:
                    del self._waiters[(channel, key)]

    def add_everything(self, heard: Heard) -> None:
        """``heard`` is told the tool_call_id of every call recorded, changing status or recording an
        event (migration 0021 announces a new call), and woken with the others on a reconnect."""
        self.loop()
        with self._lock:
            self._everything.add(heard)

    def remove_everything(self, heard: Heard) -> None:
        with self._lock:
            self._everything.discard(heard)

    def _tell_everything(self, tool_call_ids: list[str]) -> None:
        if not self._everything or not tool_call_ids:
            return
        with self._lock:
            told = list(self._everything)
        for heard in told:
            heard.take_ids(tool_call_ids)

    def _wake(self, target: tuple[str, str] | None, notice: Notice | None = None) -> None:
        """Wake the waiters of ``target`` (everyone's when None); a stream's inbox takes ``notice``."""
        with self._lock:
            if target is None:
                woken = [w for ws in self._waiters.values() for w in ws] + list(self._everything)
            else:
                woken = list(self._waiters.get(target, ()))
        for waiter in woken:
            if notice is not None and isinstance(waiter, LoopEvent):
                waiter.take(notice)
            else:
                waiter.set()

    def loop(self) -> asyncio.AbstractEventLoop:
        """This process's listening loop, started on first use (after a fork too: a gunicorn worker starts its
        own): one thread whose asyncio loop holds the LISTEN connection and serves the event streams
        (``app/stream_loop.py``), so a notice reaches a stream with no hop between threads."""
        with self._lock:
            if self._loop is not None and self._pid == os.getpid():
                return self._loop
            self._pid = os.getpid()
            made = asyncio.new_event_loop()
            made.set_default_executor(ThreadPoolExecutor(READERS, thread_name_prefix="voice-tools-stream-read"))
            threading.Thread(target=made.run_forever, name="voice-tools-events", daemon=True).start()
            # in a context of its own: not the log context (request id, call) of the request that started it
            made.call_soon_threadsafe(lambda: made.create_task(self._run(), context=contextvars.Context()))
            self._loop = made
            return made

    async def _run(self) -> None:
        while True:
            try:
                await self._listen()
            except Exception as exc:  # the database went away: wake everyone (they re-read), then listen again
                if not self._reconnecting:  # said once per outage, not once a second
                    self._reconnecting = True
                    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    log.warning("event listener lost its database connection (%s); reconnecting", first_line)
                self._wake(None)
                await asyncio.sleep(1.0)

    async def _listen(self) -> None:
        running = asyncio.get_running_loop()
        conn = await running.run_in_executor(None, _listening_connection)
        lost: asyncio.Future = running.create_future()

        def readable() -> None:
            try:
                conn.poll()
                if conn.closed:  # libpq read the server's goodbye and closed the socket: no read will come again
                    raise OperationalError("LISTEN", None, ConnectionError("the server closed the connection"))
            except Exception as exc:
                if not lost.done():
                    lost.set_exception(exc)
                return
            notes = list(conn.notifies)
            conn.notifies.clear()
            changed = []
            for target in dict.fromkeys((n.channel, n.payload) for n in notes if n.channel == STATUS_CHANNEL):
                self._wake(target)
                changed.append(target[1])
            for note in notes:  # in their order: the events' order
                if note.channel == EVENTS_CHANNEL:
                    notice = notice_of(note.payload)
                    self._wake((EVENTS_CHANNEL, notice.session_id), notice)
                    if notice.payload is not None and isinstance(notice.payload.get("tool_call_id"), str):
                        changed.append(notice.payload["tool_call_id"])
            self._tell_everything(changed)

        fd = conn.fileno()  # kept: once libpq has closed the socket, conn.fileno() raises
        try:
            self._reconnecting = False
            self._wake(None)  # anything before the LISTEN is read by the woken streams and waits
            running.add_reader(fd, readable)  # epoll: no limit at descriptor 1024
            try:
                while True:
                    try:
                        await asyncio.wait_for(asyncio.shield(lost), IDLE_CHECK_S)
                    except TimeoutError:
                        with conn.cursor() as cur:  # an idle check that the connection is alive
                            cur.execute("SELECT 1")
            finally:
                running.remove_reader(fd)  # before the number can be another connection's
        finally:
            conn.close()


def _listening_connection() -> Any:
    """A connection LISTENing on both channels: direct (LISTEN cannot pass a transaction-mode pooler), with TCP
    keep-alives, so a peer gone silent is noticed by the kernel, not by a read that never returns."""
    import psycopg2

    conn = psycopg2.connect(db.listen_url(), keepalives=1, keepalives_idle=30, keepalives_interval=10,
                            keepalives_count=3)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"LISTEN {EVENTS_CHANNEL}; LISTEN {STATUS_CHANNEL}")
    except BaseException:
        conn.close()
        raise
    return conn


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


async def session_events_async(session_id: str, after: int, keepalive_s: float, caller: str | None = None,
                               direct: Callable[[Notice], bool] | None = None) -> AsyncIterator[Row | Notice | None]:
    """:func:`session_events` for an asyncio task: the same events in the same order (rows read from the
    table, then :class:`Notice` s as they arrive, each with ``event_id``, ``payload`` and ``commit_seq``),
    the same keep-alive Nones. It reads the table when it starts and then only when its inbox says so
    (module docstring); it waits on its loop (no thread), and a keep-alive reads nothing, so a thousand
    idle streams do not read a thousand times every interval.

    ``direct``, when given, writes a notice to the stream's client at once (True) or declines (False:
    the notice is queued and yielded as usual). It is called by the listener, on the loop, only while
    this generator waits with an empty inbox, for a notice that is new to this stream and its caller's:
    what it writes is not yielded."""
    loop = asyncio.get_running_loop()
    inbox = LISTENER.subscribe_loop(session_id, loop)

    def deliver(notice: Notice) -> bool:
        """A notice taken while this stream waits: written by ``direct`` at once (True), else queued."""
        nonlocal after
        assert notice.commit_seq is not None
        if notice.commit_seq <= after or (caller is not None and notice.caller != caller):
            return True  # read already, or not this caller's
        if not direct(notice):
            return False
        after = notice.commit_seq
        return True

    if direct is not None:
        inbox.direct = deliver
    try:
        while True:
            if not inbox.inbox:
                inbox.event.clear()
                inbox.waiting = True
                try:  # asyncio.timeout: no task made for each wait (wait_for's), half the cost of a wake
                    async with asyncio.timeout(keepalive_s):
                        await inbox.event.wait()
                    idle = False
                except TimeoutError:
                    idle = True
                finally:
                    inbox.waiting = False
                if idle:
                    yield None
                continue
            item = inbox.inbox.popleft()
            if item is not READ and item.payload is not None:
                if item.commit_seq <= after or (caller is not None and item.caller != caller):
                    continue  # read already, or not this caller's
                after = item.commit_seq
                yield item
                continue
            if item is not READ and item.commit_seq is not None and item.commit_seq <= after:
                continue
            while inbox.inbox and inbox.inbox[0] is READ:  # one read does for them all
                inbox.inbox.popleft()
            try:
                rows = await asyncio.shield(_read_soon(loop, session_id, after, caller))
            except (OperationalError, InterfaceError):
                log.warning("event stream of %s ended: database unavailable", session_id)
                return
            for row in rows:
                after = row.commit_seq
                yield row
            if len(rows) == BATCH:
                inbox.inbox.appendleft(READ)
    finally:
        LISTENER.unsubscribe(session_id, inbox)


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
