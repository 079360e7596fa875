"""``GET /console/api/live``: the console's live list, as Server-Sent Events read with ``fetch``
(which, unlike an ``EventSource``, sends the ``Authorization`` header).

No polling, and a list costs only its own caller's changes. The process's one listener
(``models/listen.py``) tells the process's one :class:`Lists` (on the stream loop) the id of every call
recorded, changing status or recording an event; it gathers them for ``GATHER_S`` and reads the changed
rows in one statement for every open list of the process (``browse.rows_of``, unscoped), then hands each
list the rows its caller may see (an admin's: all of them, the firehose). A list whose caller has no
changed row is not woken. A call's caller never changes, so the ids of calls already read are known by
their caller (the latest :data:`KNOWN` of them): a change of a known call whose caller has no open list
(and no admin's list is open) is not read at all; a new call is read once, however many lists are open.
A ``reread`` frame, first (once subscribed, so nothing recorded after the page's read is missed) and
whenever notices may have been lost, tells the page to read its list again. Served as the event stream is:
the connection is handed to the stream loop (``app/stream_loop.py``), holding no web thread, counted in
the caller's open share (``app/shares.py``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from typing import AsyncIterator

from flask import Blueprint, Response, g, request
from sqlalchemy.exc import InterfaceError, OperationalError

from app import handover, shares, sse, stream, stream_loop
from app.console.pages import DATA_PREFIX
from models import listen
from tasks.calls import browse
from tasks.calls.callers import Caller
from tasks.calls.errors import ApiError

log = logging.getLogger(__name__)

bp = Blueprint("console_live", __name__, url_prefix=DATA_PREFIX.rstrip("/"))

GATHER_S = 0.25  # at most four reads a second per process, however many lists are open and however busy
KEEPALIVE_S = 15.0
REREAD = "event: reread\ndata: {}\n\n"
KNOWN = 65536  # calls whose caller this process remembers
LIST_INBOX = 64  # frames a list keeps for its client before it is told to read its list again instead
_END = object()  # the database is away: the lists end


def calls_frame(rows: list[dict]) -> str:
    return f"event: calls\ndata: {json.dumps(rows, separators=(',', ':'))}\n\n"


class Lists:
    """The open live lists of this process, fed by one reader on the stream loop (all of it runs there)."""

    def __init__(self) -> None:
        self.open: dict[asyncio.Queue, Caller] = {}
        self.known: OrderedDict[str, str] = OrderedDict()  # tool_call_id -> its caller
        self.heard: listen.Heard | None = None
        self.reader: asyncio.Task | None = None

    def join(self, who: Caller) -> asyncio.Queue:
        """A new list's inbox (its first frame: ``reread``); the reader starts with the first list."""
        inbox: asyncio.Queue = asyncio.Queue(LIST_INBOX)
        if self.heard is None:
            self.heard = listen.Heard(asyncio.get_running_loop())
            listen.LISTENER.add_everything(self.heard)  # before the page's read: nothing after it is missed
        if self.reader is None or self.reader.done():
            self.reader = asyncio.get_running_loop().create_task(self._read(self.heard))
        self.open[inbox] = who
        inbox.put_nowait(REREAD)
        return inbox

    def leave(self, inbox: asyncio.Queue) -> None:
        self.open.pop(inbox, None)
        if not self.open and self.heard is not None:
            listen.LISTENER.remove_everything(self.heard)
            self.heard = None
            if self.reader is not None:
                self.reader.cancel()
                self.reader = None

    def _tell(self, inbox: asyncio.Queue, frame: object) -> None:
        try:
            inbox.put_nowait(frame)
        except asyncio.QueueFull:  # a client slower than its changes: it reads its list again
            while not inbox.empty():
                inbox.get_nowait()
            inbox.put_nowait(REREAD)

    def wanted(self, ids: set[str]) -> list[str]:
        """The changed calls some open list may show: all when an admin's list is open; else those not
        known, or known to be of a caller with a list open."""
        if any(who.admin for who in self.open.values()):
            return sorted(ids)
        callers = {who.name for who in self.open.values()}
        return sorted(i for i in ids if self.known.get(i, None) in callers or i not in self.known)

    def _learn(self, rows: list[dict]) -> None:
        for row in rows:
            self.known[row["tool_call_id"]] = row["caller"]
            self.known.move_to_end(row["tool_call_id"])
        while len(self.known) > KNOWN:
            self.known.popitem(last=False)

    async def _read(self, heard: listen.Heard) -> None:
        running = asyncio.get_running_loop()
        while True:
            await heard.event.wait()
            await asyncio.sleep(GATHER_S)
            ids, reread = heard.drain()
            if reread:
                for inbox in self.open:
                    self._tell(inbox, REREAD)
            wanted = self.wanted(ids)
            if not wanted or not self.open:
                continue
            try:
                rows = await running.run_in_executor(None, browse.rows_of, wanted, None)
            except (OperationalError, InterfaceError):
                log.warning("console live lists ended: database unavailable")
                for inbox in list(self.open):
                    self._tell(inbox, _END)
                continue
            self._learn(rows)
            for inbox, who in list(self.open.items()):
                shown = rows if who.admin else [row for row in rows if row["caller"] == who.name]
                if shown:
                    self._tell(inbox, calls_frame(shown))


LISTS = Lists()  # this process's, used on its stream loop only


async def frames(who: Caller) -> AsyncIterator[str]:
    """The frames of one live list: ``reread`` first, then the rows of its caller's calls that changed."""
    inbox = LISTS.join(who)
    try:
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    frame = await inbox.get()
            except TimeoutError:
                yield sse.KEEPALIVE
                continue
            if frame is _END:
                return
            yield frame  # type: ignore[misc]
    finally:
        LISTS.leave(inbox)


@bp.get("/live")
def live():
    sock = handover.socket_of(request.environ)
    if sock is None:
        raise ApiError(503, "unavailable", "The live list needs a plain HTTP/1.1 connection to the API's server.", {})
    who = g.who
    slot = shares.take_slot(who.name, "stream", holds_thread=False)  # 429 past the caller's open share
    body = stream.HandOver(sock, slot, lambda own: stream_loop.serve_frames(own, lambda: frames(who), slot, True,
                                                                            "console live list"))
    response = Response(body, mimetype="text/event-stream")
    response.call_on_close(body.closed)
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    return response
