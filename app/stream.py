"""``GET /voice-tools/events/<session_id>``: the session's events as Server-Sent Events.

For relays that cannot expose a callback endpoint. The events are the callback rows
themselves (``callback_deliveries``, one source of truth; an event with no callback URL
is recorded too), each sent as::

    id: <event_id>
    event: <its kind: progress, checkpoint, completed, failed, cancelled or expired>
    data: <the callback body, JSON>

after a first ``retry:`` line (how many milliseconds a client waits before it reconnects),
in the stable order ``models/listen.py`` reads them in, woken by its LISTEN/NOTIFY
listener; a client that reconnects with ``Last-Event-ID`` (the header, or the
``last_event_id`` query parameter for clients that cannot set headers) gets exactly what
it missed: no loss, no duplicate. A call's own events are also in ``seq`` order. A
keep-alive comment is written every ``KEEPALIVE_S`` seconds.

The view answers as any other (token, rate, the caller's open share and the process's capacity of
``app/shares.py``: past them, 429; its errors), writes the head and the opening, then hands the
connection to the process's stream loop (``app/stream_loop.py``, ``app/handover.py``): an open stream
holds no web thread, and no database connection while idle; a client that takes nothing for the send
timeout is closed (docs/operations.md, "Event streams, waits and threads"). A server
that hands the app no plain socket (HTTP/2, TLS in the app server, a test client) streams from
the request's thread instead. Browsers are not served: an ``EventSource`` cannot send the
``Authorization`` header every request needs.
"""
from __future__ import annotations

import re
import socket
from contextlib import closing
from typing import Any, Callable, Iterator

from flask import Blueprint, Response, g, request, stream_with_context
from marshmallow import RAISE, Schema, fields

from app import handover, inputs, shares, sse, stream_loop
from app.openapi import doc
from models import listen
from models.events import KINDS as EVENT_KINDS
from tasks.calls import schemas
from tasks.calls.errors import validation_error

bp = Blueprint("events", __name__)

KEEPALIVE_S = 15.0
RETRY_MS = sse.RETRY_MS
# every event id is 32 lowercase hex digits (models/events.py: uuid4().hex)
EVENT_ID = re.compile(r"[0-9a-f]{32}")


class EventsQuery(Schema):
    last_event_id = fields.String(metadata={"description": "Resume after this event (or the Last-Event-ID header)"})

    class Meta:
        unknown = RAISE


def _cursor_after(session_id: str, last_event_id: str | None, caller: str | None = None) -> int:
    """Where to start: after ``last_event_id`` (which must be one of the session's events, of the
    caller's calls when ``caller`` is given), or the beginning."""
    if not last_event_id:
        return 0
    found = None
    if EVENT_ID.fullmatch(last_event_id):  # anything else names no event (and a NUL must not reach the driver)
        found = listen.event_position(last_event_id, caller)
    if found is None or found.session_id != session_id:
        raise validation_error({"last_event_id": [f"No event {last_event_id!r} in session {session_id}."]})
    return found.commit_seq


def stream(session_id: str, after: int, keepalive_s: float = KEEPALIVE_S,
           caller: str | None = None, slot: shares.Slot | None = None) -> Iterator[str]:
    """The session's events numbered after ``after`` (``models/listen.py``) as frames, then new ones as they are recorded,
    with keep-alive comments; only those of ``caller``'s calls when it is given (None: an
    operator's, every event). The stream's ``slot`` of its caller's open share is renewed by its process."""
    yield sse.OPENING
    with closing(listen.session_events(session_id, after, keepalive_s, caller)) as events:
        for event in events:  # a client gone closes this generator, and so the listener's subscription
            yield sse.KEEPALIVE if event is None else sse.frame(event.event_id, event.payload)


class HandOver:
    """The answer's body under a server that gave its socket: the opening (the server writes it after
    the head), then the connection goes to the stream loop (``go_on(socket)``, which then owns the slot), and the server is
    left a closed pipe in its place, so what it writes to end the answer reaches no one."""

    def __init__(self, sock: socket.socket, slot: shares.Slot, go_on: Callable[[socket.socket], None]) -> None:
        self.sock, self.slot, self.go_on = sock, slot, go_on
        self.handed = False

    def __iter__(self) -> Iterator[str]:
        yield sse.OPENING
        own = handover.take(self.sock)  # the server's descriptor now names a closed pipe, not the client
        self.handed = True
        self.go_on(own)  # the stream loop's now, with the slot

    def closed(self) -> None:
        """The server closed the answer: the slot is the stream loop's if it was handed over, else free."""
        if not self.handed:
            self.slot.release()


@bp.get("/voice-tools/events/<session_id>")
@doc("The session's events as Server-Sent Events (resumable with Last-Event-ID)", tag="events", query=EventsQuery,
     responses={200: ("text/event-stream",
                      "A first `retry: <milliseconds>` line, then per event `id: <event_id>`, `event: <kind>` and "
                      "`data: <the callback body>` (a CallbackEvent, without sent_at), and a `: keep-alive` comment "
                      f"every {KEEPALIVE_S:g} s. Browsers are not served (an EventSource cannot send Authorization)",
                      {"type": "object", "required": ["id", "event", "data"],
                       "properties": {
                           "id": {"type": "string", "description": "The event's event_id: Last-Event-ID resumes after "
                                                                   "it", "pattern": "^[0-9a-f]{32}$"},
                           "event": {"type": "string", "enum": list(EVENT_KINDS),
                                     "description": "The kind of event (addEventListener(kind))"},
                           "data": {"type": "string", "description": "The callback body as JSON: "
                                                                     "#/components/schemas/CallbackEvent (no sent_at)",
                                    "x-json-schema": {"$ref": "#/components/schemas/CallbackEvent"}},
                           "retry": {"type": "integer", "description": "Sent once, first: milliseconds to wait "
                                                                      "before reconnecting"}}})})
def events(session_id: str):
    session_id = schemas.load(schemas.SessionPath, {"session_id": session_id})["session_id"]
    query = schemas.load(EventsQuery, inputs.query())
    last = request.headers.get("Last-Event-ID") or query.get("last_event_id")
    scope = g.who.scope  # a caller sees the events of its own calls only; an admin, all of them
    after = _cursor_after(session_id, last, scope)
    sock = handover.socket_of(request.environ)
    slot = shares.take_slot(g.who.name, "stream", holds_thread=sock is None)  # 429 past the caller's open share
    if sock is not None:
        body = HandOver(sock, slot, lambda own: stream_loop.serve(own, session_id, after, scope, slot, chunked=True,
                                                                  keepalive_s=KEEPALIVE_S))
        response = Response(body, mimetype="text/event-stream")
        response.call_on_close(body.closed)
    else:
        response = Response(stream_with_context(stream(session_id, after, caller=scope, slot=slot)),
                            mimetype="text/event-stream")
        response.call_on_close(slot.release)  # when the server closes the answer, begun or not
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # no proxy buffering
    return response
