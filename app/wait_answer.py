"""A REST ``?wait`` answered by the stream loop (``app/stream_loop.py``): it holds no web thread.

The view runs the operation on its thread as any other (the token, the rate, the caller's open share and
the process's capacity of ``app/shares.py``, the input, the transition: their errors are answered at
once); the wait it asks for (``tasks.calls.operations.Waiting``) is given here. The answer's head is
not known yet (200 with the call's record once it is PREPARED or final, else 202), so the connection is
taken from the server before it writes anything (``app/handover.py``), with the headers the app gave the
answer (``X-Request-ID``); the stream loop waits on the listener (``models.listen.until_settled_async``)
and writes the whole answer then, with ``Connection: close``. A client gone meanwhile ends the wait;
one that does not take the answer is closed after the send timeout. Where the server hands no socket
over (TLS or HTTP/2 in the app server, a test client) the wait is waited on the request's thread.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Iterator

from flask import Flask, Response, current_app, g, request

from app import handover, shares, stream_loop
from models import listen
from tasks.calls import errors
from tasks.calls.operations import HandOver, Waiting

log = logging.getLogger(__name__)

METHODS = ("POST",)  # the views that wait (confirm, execute, resume, the legacy aliases); app/shares.py asks too


def hand_over() -> HandOver | None:
    """How this request's wait is answered without its thread, or None: waited on the thread."""
    sock = handover.socket_of(request.environ, METHODS)
    slot = g.get("share_slot")
    if sock is None or slot is None or slot.in_process:
        return None
    return lambda waiting: _answer_later(sock, waiting)


class _Later:
    """The answer's body as the server sees it: nothing. When the server asks for it, the connection is
    handed to the stream loop with the headers the app gave the answer (its first look at them is then)."""

    def __init__(self, sock: socket.socket, slot: shares.Slot, waiting: Waiting, app: Flask) -> None:
        self.sock, self.slot, self.waiting, self.app = sock, slot, waiting, app
        self.response: Response | None = None
        self.handed = False

    def __iter__(self) -> Iterator[bytes]:
        assert self.response is not None
        own = handover.take(self.sock)
        self.handed = True
        headers = [(name, value) for name, value in self.response.headers.items()
                   if name.lower() != "content-type"] + [("Content-Type", "application/json")]
        stream_loop.serve_wait(own, self.slot, self._answer, headers)
        return iter(())

    async def _answer(self) -> tuple[bytes, int]:
        running = asyncio.get_running_loop()
        try:
            call, settled = await listen.until_settled_async(self.waiting.tool_call_id, self.waiting.seconds)
            payload, status = await running.run_in_executor(None, self.waiting.answer, call, settled)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # answered as the REST API answers it (a database away: 503)
            err = errors.api_error(exc)
            if err is None:
                log.exception("wait on %s failed", self.waiting.tool_call_id)
                err = errors.internal_error()
            payload, status = errors.payload(err), err.status
        return self.app.json.response(payload).get_data(), status  # as Flask writes a view's JSON

    def closed(self) -> None:
        """The server closed the answer: the slot is the stream loop's if it was handed over, else free."""
        if not self.handed:
            self.slot.release()


def _answer_later(sock: socket.socket, waiting: Waiting) -> Response:
    slot = g.pop("share_slot")  # the stream loop's now: it gives it back when the answer is written
    body = _Later(sock, slot, waiting, current_app._get_current_object())  # type: ignore[attr-defined]
    response = Response(body, status=202, mimetype="application/json")
    body.response = response
    response.call_on_close(body.closed)
    return response
