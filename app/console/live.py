"""``GET /console/api/live``: the console's live list, as Server-Sent Events read with ``fetch``
(which, unlike an ``EventSource``, sends the ``Authorization`` header).

No polling: the process's one listener (``models/listen.py``) tells the stream the id of every
call recorded, changing status or recording an event; the stream gathers them for
``GATHER_S`` and reads their rows in one statement, only those the caller may see (an admin,
every call: the firehose), and sends them as one ``calls`` frame. A ``reread`` frame, first
(once subscribed, so nothing recorded after the page's read is missed) and whenever notices may
have been lost, tells the page to read its list again. Served as the event stream is: the
connection is handed to the stream loop (``app/stream_loop.py``), holding no web thread, counted
in the caller's open share (``app/shares.py``).
"""
from __future__ import annotations

import asyncio
import json
import logging
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

GATHER_S = 0.25  # at most four reads a second per open list, however busy the system
KEEPALIVE_S = 15.0
REREAD = "event: reread\ndata: {}\n\n"


def calls_frame(rows: list[dict]) -> str:
    return f"event: calls\ndata: {json.dumps(rows, separators=(',', ':'))}\n\n"


async def frames(who: Caller) -> AsyncIterator[str]:
    """The frames of one live list: ``reread`` first, then the rows of the calls that changed."""
    changes = listen.calls_changed(KEEPALIVE_S, GATHER_S)
    running = asyncio.get_running_loop()
    try:
        async for item in changes:
            if item is None:
                yield sse.KEEPALIVE
                continue
            ids, reread = item
            if reread:
                yield REREAD
            if ids:
                try:
                    rows = await running.run_in_executor(None, browse.rows_of, sorted(ids), who)
                except (OperationalError, InterfaceError):
                    log.warning("console live list ended: database unavailable")
                    return
                if rows:
                    yield calls_frame(rows)
    finally:
        await changes.aclose()


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
