"""The asyncio thread of an API process that answers the connections handed over to it (``app/handover.py``):
each open event stream, and each ``?wait`` until its answer, is a task writing to the client's socket,
holding no web thread and, while idle, no database connection.

Every write is bounded: a client that leaves data it was sent untaken for ``VOICE_TOOLS_SEND_TIMEOUT``
seconds (``models.settings.send_timeout_s``) is closed (reset: the kernel keeps nothing for it), its task
ends, its listener subscription is removed and its slot given back. A task's data counts as taken when
the client's TCP stack has acknowledged it: what was written less what is still in the transport's
buffer and in the kernel's send queue (``TIOCOUTQ``). The process's one watch task looks at every
connection about once a second, a slice of them at a time between the loop's other work (the kernel is
asked only about a connection that had data waiting at the last look, or was written to since).
"""
from __future__ import annotations

import asyncio
import email.utils
import fcntl
import logging
import socket
import struct
import termios
import time
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable

from app import shares, sse, stream_gauges
from models import listen, settings

log = logging.getLogger(__name__)

_open = 0  # streams this process serves now
_waits = 0  # waits this process holds now
WATCH_EVERY_S = 1.0  # at most; a shorter send timeout is watched four times per period
WATCH_SLICE = 50  # connections the watch looks at before it hands the loop back for a turn


def loop() -> asyncio.AbstractEventLoop:
    """This process's stream loop: the listener's own (``models/listen.py``), started on first use."""
    return listen.LISTENER.loop()


def open_streams() -> int:
    """How many event streams this process serves now."""
    return _open


def held_waits() -> int:
    """How many ``?wait`` requests this process holds now (on its stream loop)."""
    return _waits


# -- a connection: its writes, and how much of them its client took ------------------------------------

class Connection:
    """A client's connection served by a task of the loop: what was written to it, and since when the client
    has taken none of what waits for it."""

    def __init__(self, writer: asyncio.StreamWriter, task: asyncio.Task) -> None:
        self.writer, self.task = writer, task
        self.written = 0
        self.taken = 0
        self.since = time.monotonic()  # when the client last took something, or had nothing waiting
        sock = writer.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1
        self.stalled = False

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self.writer.write(data)

    def untaken(self) -> int:
        """Bytes written that the client has not acknowledged yet."""
        queued = self.writer.transport.get_write_buffer_size()
        if self.fd >= 0:
            try:
                queued += struct.unpack("i", fcntl.ioctl(self.fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:
                pass
        return queued

    def check(self, now: float, timeout: float) -> bool:
        """Is the client past the bound (data waiting for it, none taken, for ``timeout`` seconds)?"""
        if self.written == self.taken:  # it had taken everything at the last look, and nothing was written since
            self.since = now
            return False
        untaken = self.untaken()
        taken = self.written - untaken
        if untaken == 0 or taken > self.taken:
            self.taken, self.since = taken, now
            return False
        return now - self.since >= timeout

    def reset(self) -> None:
        """Close at once, discarding what the client did not take (a reset, not a FIN after the data)."""
        self.stalled = True
        sock = self.writer.get_extra_info("socket")
        try:
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.writer.transport.abort()
        self.task.cancel()


_connections: set[Connection] = set()
_watching: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}


def _watch(running: asyncio.AbstractEventLoop) -> None:
    if running not in _watching or _watching[running].done():
        _watching[running] = running.create_task(_watch_forever())


async def _watch_forever(connections: set[Connection] | None = None) -> None:
    """Look at ``connections`` (the loop's own: ``_connections``) about every ``WATCH_EVERY_S``."""
    watched = _connections if connections is None else connections
    while True:
        timeout = settings.send_timeout_s()
        await asyncio.sleep(min(WATCH_EVERY_S, timeout / 4))
        for k, connection in enumerate(list(watched)):
            if k % WATCH_SLICE == 0:  # the loop's other work (an event for the streams) waits a slice at most
                await asyncio.sleep(0)
                now = time.monotonic()
            if connection not in watched:  # closed meanwhile: its descriptor may be another's now
                continue
            try:
                if connection.check(now, timeout):
                    log.info("a client took nothing for %g s: its connection is closed", timeout)
                    connection.reset()
            except Exception:  # one connection's trouble never stops the watch
                log.exception("connection not checked")


async def _served(sock: socket.socket, slot: shares.Slot, body: Callable[[Connection], Awaitable[bool]],
                  what: str) -> None:
    """Serve ``sock`` with ``body(connection)`` (True: it ended the answer, the connection is closed
    politely) until it returns or the client goes; then close the connection and give ``slot`` back.
    A ``body`` that raises leaves its client without an answer (or the rest of one): it is logged,
    unless it is the client's going (an ``OSError``)."""
    running = asyncio.get_running_loop()
    writer: asyncio.StreamWriter | None = None
    connection: Connection | None = None
    tasks: list[asyncio.Future] = []
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
        current = asyncio.current_task()
        assert current is not None
        connection = Connection(writer, current)
        _connections.add(connection)
        _watch(running)
        answer = asyncio.ensure_future(body(connection))
        gone = asyncio.ensure_future(_until_closed(reader))
        tasks = [answer, gone]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if answer.done() and not answer.cancelled():
            failed = answer.exception()
            if failed is not None:
                raise failed  # the client gets no answer: logged below, unless it went first (an OSError)
            if answer.result():
                await writer.drain()
    except (OSError, asyncio.CancelledError):
        pass
    except Exception:
        log.exception("%s failed", what)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if connection is not None:
            _connections.discard(connection)
        if writer is not None:
            writer.close()
        else:
            sock.close()
        await running.run_in_executor(None, slot.release)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Returns when the client closed its side (a client sends nothing more after its request)."""
    while await reader.read(4096):
        pass


# -- an event stream ---------------------------------------------------------------------------------

def serve(sock: socket.socket, session_id: str, after: int, caller: str | None, slot: shares.Slot,
          chunked: bool, keepalive_s: float) -> None:
    """Go on with a stream whose head and opening were written on ``sock`` (a connected socket this
    call now owns): its events after ``after`` (``models/listen.py``), chunk-framed if ``chunked``, with
    keep-alives, until the client goes, takes nothing for the send timeout, or the database is away; then
    ``slot`` is released."""
    def frames(connection: Connection) -> AsyncIterator[str]:
        return session_frames(session_id, after, caller, keepalive_s, _writer_of(connection, chunked))

    asyncio.run_coroutine_threadsafe(_serve(sock, frames, slot, chunked, f"event stream of {session_id}"), loop())


def serve_frames(sock: socket.socket, frames: Callable[[], AsyncIterator[str]], slot: shares.Slot,
                 chunked: bool, what: str) -> None:
    """As :func:`serve`, for any stream of frames (``frames()``: made and run on the loop), such as the
    console's live list (``app/console/live.py``)."""
    asyncio.run_coroutine_threadsafe(_serve(sock, lambda _: frames(), slot, chunked, what), loop())


_last_frame: tuple[Any, bool, bytes] | None = None  # the notice whose frame was made last: one per notice


def _writer_of(connection: Connection, chunked: bool) -> Callable[[listen.Notice], bool]:
    """What writes a notice to ``connection`` at once, from the listener's callback (``models/listen.py``):
    the streams of a session get it in one turn of the loop, its frame made once for them all. It declines
    (the stream's task writes the notice then) while the client has not taken what was written before."""
    transport = connection.writer.transport

    def write(notice: listen.Notice) -> bool:
        global _last_frame
        if transport.is_closing() or transport.get_write_buffer_size():
            return False
        if _last_frame is None or _last_frame[0] is not notice or _last_frame[1] != chunked:
            assert notice.event_id is not None and notice.payload is not None
            _last_frame = (notice, chunked, _chunk(sse.frame(notice.event_id, notice.payload), chunked))
        connection.write(_last_frame[2])
        return True

    return write


async def session_frames(session_id: str, after: int, caller: str | None, keepalive_s: float,
                         direct: Callable[[listen.Notice], bool] | None = None) -> AsyncIterator[str]:
    """The session's events after ``after`` as frames, with keep-alives (``models/listen.py``); ``direct``
    writes a notice at once while the stream waits (:func:`_writer_of`)."""
    events: Any = listen.session_events_async(session_id, after, keepalive_s, caller, direct)
    try:
        async for event in events:
            yield sse.KEEPALIVE if event is None else sse.frame(event.event_id, event.payload)
    finally:
        await events.aclose()


def _chunk(text: str, chunked: bool) -> bytes:
    data = text.encode()
    return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data


async def _serve(sock: socket.socket, frames: Callable[[Connection], AsyncIterator[str]], slot: shares.Slot,
                 chunked: bool, what: str) -> None:
    global _open
    _open += 1
    stream_gauges.STREAMS_OPEN.inc()

    async def pump(connection: Connection) -> bool:
        texts: Any = frames(connection)
        try:
            async for text in texts:
                connection.write(_chunk(text, chunked))
                await connection.writer.drain()
        finally:
            await texts.aclose()
        if chunked:  # the stream ended (the database is away): the client reconnects with Last-Event-ID
            connection.write(b"0\r\n\r\n")
        return True

    try:
        await _served(sock, slot, pump, what)
    finally:
        _open -= 1
        stream_gauges.STREAMS_OPEN.dec()


# -- a wait's answer ----------------------------------------------------------------------------------

def serve_wait(sock: socket.socket, slot: shares.Slot, answer: Callable[[], Awaitable[tuple[bytes, int]]],
               headers: list[tuple[str, str]]) -> None:
    """Answer a ``?wait`` on ``sock`` (a connected socket this call now owns, nothing written to it yet)
    once ``answer()`` has it (its JSON body and HTTP status), with ``headers``; the connection is closed
    after (``Connection: close``), and at once if the client goes first. Then ``slot`` is released."""
    asyncio.run_coroutine_threadsafe(_serve_wait(sock, slot, answer, headers), loop())


def http_answer(status: int, body: bytes, headers: list[tuple[str, str]]) -> bytes:
    """A whole HTTP/1.1 answer: its status line, ``headers``, its length, ``Connection: close``, ``body``."""
    drop = {"content-length", "connection", "transfer-encoding", "date"}
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
             f"Date: {email.utils.formatdate(usegmt=True)}",
             *(f"{name}: {value}" for name, value in headers if name.lower() not in drop),
             f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _serve_wait(sock: socket.socket, slot: shares.Slot, answer: Callable[[], Awaitable[tuple[bytes, int]]],
                      headers: list[tuple[str, str]]) -> None:
    global _waits
    _waits += 1

    async def respond(connection: Connection) -> bool:
        body, status = await answer()
        connection.write(http_answer(status, body, headers))
        return True

    try:
        await _served(sock, slot, respond, "wait")
    finally:
        _waits -= 1
