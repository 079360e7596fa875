"""The asyncio thread of an API process that serves the event streams handed over to it: each open stream is
a task writing to the client's socket, holding no web thread and, while idle, no database connection."""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, AsyncIterator, Callable

from app import metrics, shares, sse
from models import listen

log = logging.getLogger(__name__)

_open = 0  # streams this process serves now


def loop() -> asyncio.AbstractEventLoop:
    """This process's stream loop: the listener's own (``models/listen.py``), started on first use."""
    return listen.LISTENER.loop()


def open_streams() -> int:
    """How many event streams this process serves now."""
    return _open


def serve(sock: socket.socket, session_id: str, after: int, caller: str | None, slot: shares.Slot,
          chunked: bool, keepalive_s: float) -> None:
    """Go on with a stream whose head and opening were written on ``sock`` (a connected socket this
    call now owns): its events after ``after`` (``models/listen.py``), chunk-framed if ``chunked``, with
    keep-alives, until the client goes or the database is away; then ``slot`` is released."""
    serve_frames(sock, lambda: session_frames(session_id, after, caller, keepalive_s), slot, chunked,
                 f"event stream of {session_id}")


def serve_frames(sock: socket.socket, frames: Callable[[], AsyncIterator[str]], slot: shares.Slot,
                 chunked: bool, what: str) -> None:
    """As :func:`serve`, for any stream of frames (``frames()``: made and run on the loop)."""
    asyncio.run_coroutine_threadsafe(_serve(sock, frames, slot, chunked, what), loop())


def _chunk(text: str, chunked: bool) -> bytes:
    data = text.encode()
    return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data


async def _serve(sock: socket.socket, frames: Callable[[], AsyncIterator[str]], slot: shares.Slot,
                 chunked: bool, what: str) -> None:
    global _open
    _open += 1
    metrics.STREAMS_OPEN.inc()
    running = asyncio.get_running_loop()
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
        pump = asyncio.ensure_future(_pump(writer, frames(), slot, chunked))
        gone = asyncio.ensure_future(_until_closed(reader))
        done, _ = await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in (pump, gone):
            task.cancel()
        await asyncio.gather(pump, gone, return_exceptions=True)
        if chunked and pump in done and pump.exception() is None:  # the stream ended (the database is away)
            writer.write(b"0\r\n\r\n")  # the answer's end: the client reconnects with Last-Event-ID
            await writer.drain()
    except (OSError, asyncio.CancelledError):
        pass
    except Exception:
        log.exception("%s failed", what)
    finally:
        _open -= 1
        metrics.STREAMS_OPEN.dec()
        if writer is not None:
            writer.close()
        else:
            sock.close()
        await running.run_in_executor(None, slot.release)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Returns when the client closed its side (an SSE client sends nothing after its request)."""
    while await reader.read(4096):
        pass


async def session_frames(session_id: str, after: int, caller: str | None, keepalive_s: float) -> AsyncIterator[str]:
    """The session's events after ``after`` as frames, with keep-alives (``models/listen.py``)."""
    events: Any = listen.session_events_async(session_id, after, keepalive_s, caller)
    try:
        async for event in events:
            yield sse.KEEPALIVE if event is None else sse.frame(event.event_id, event.payload)
    finally:
        await events.aclose()


async def _pump(writer: asyncio.StreamWriter, frames: AsyncIterator[str], slot: shares.Slot, chunked: bool) -> None:
    running = asyncio.get_running_loop()
    try:
        async for text in frames:
            writer.write(_chunk(text, chunked))
            await writer.drain()
            if slot.renewal_due():
                await running.run_in_executor(None, slot.renew)
    finally:
        await frames.aclose()  # type: ignore[attr-defined]
