"""The MCP port's HTTP/1.1 (both its hosts: ``voice-tools mcp`` and the API's worker under ``voice-tools run``):
uvicorn's h11 protocol with REST's framing rules and answers (``app/http_framing.py``).

uvicorn's h11 protocol reads a request with both Content-Length and Transfer-Encoding (h11 takes the
chunked body) and keeps its connection, answers what h11 refuses in plain text, waits for a head with
no bound (its keep-alive timeout runs only between requests, and ends at the first byte) and holds up
to h11's 16 KB of one head line. Here, on the same protocol:

- a head is measured as it comes, with gunicorn's limits (414, 431, a bare LF a 400), and h11 may buffer
  as long a head as gunicorn accepts;
- a request with both framings, a chunk line ended by a bare LF and whatever h11 refuses are answered
  in JSON (h11's status: 400 or 431; a transfer coding other than chunked, h11's 501, a 400),
  ``Connection: close``; the client's late bytes are read and
  dropped for a while (so that it reads its answer rather than a reset), then the connection is closed;
- a head not whole within ``HEAD_SECONDS`` of the connection or of its first byte, or a body not whole
  within ``BODY_SECONDS`` of its head, closes the connection without an answer, as REST does.

It reads h11's buffer of bytes not yet parsed (``Connection._receive_buffer``), as h11 0.16 keeps it
(pinned in setup.cfg).
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from app import http_framing
from app.limits import BODY_SECONDS, HEAD_SECONDS, MAX_BODY_BYTES

LINGER_SECONDS = 2.0  # as REST's worker: how long a refused connection's late bytes are read and dropped
LINGER_BYTES = http_framing.MAX_HEAD_BYTES + MAX_BODY_BYTES


class _Checked(h11.Connection):
    """h11's server connection whose events pass REST's framing rules; ``refusal`` says why one did not."""

    def __init__(self, on_event: Callable[[Any], None]) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=http_framing.MAX_HEAD_BYTES)
        self.on_event = on_event
        self.refusal: http_framing.Refused | None = None
        self._head: http_framing.HeadLimits | None = http_framing.HeadLimits()
        self._scanned = 0  # bytes of the head under way measured so far

    def next_event(self) -> Any:
        try:
            self._measure_head()
            event = super().next_event()
            http_framing.check(self, event)
        except http_framing.Refused as refused:
            self.refusal = refused
            raise h11.RemoteProtocolError(refused.mesg, error_status_hint=refused.status) from None
        except h11.RemoteProtocolError as exc:
            # a transfer coding h11 cannot read is h11's 501: a 400 here, as the documented codes have no 5xx
            # for what a client sent
            status = 400 if exc.error_status_hint == 501 else exc.error_status_hint
            self.refusal = http_framing.Refused(status, str(exc))
            raise
        if isinstance(event, h11.Request):
            self._head, self._scanned = http_framing.HeadLimits(), 0  # the next request's
        self.on_event(event)
        return event

    def _measure_head(self) -> None:
        """The bytes h11 holds of a head it has not parsed yet (it parses a head only once it is whole)."""
        if self.their_state is not h11.IDLE or self._head is None:
            return
        pending = self._receive_buffer._data
        if len(pending) > self._scanned:
            new = bytes(pending[self._scanned:])
            self._scanned = len(pending)
            if self._head.feed(new) is not None:
                self._head = None  # whole: h11 parses it now (bytes after it are its body, or the next request)

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._head, self._scanned = http_framing.HeadLimits(), 0


class FramedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (``uvicorn.Config(http=...)``) with REST's framing rules, answers and deadlines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Checked(self._framed)
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering = 0  # bytes a refused connection may still send, dropped; 0: not refused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(HEAD_SECONDS)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingering -= len(data)
            if self._lingering <= 0:
                self.transport.close()
            return
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm(HEAD_SECONDS)  # a kept-alive connection's next head: from its first byte
        super().data_received(data)

    def _framed(self, event: Any) -> None:
        if isinstance(event, h11.Request):
            self._arm(BODY_SECONDS)
        elif isinstance(event, h11.EndOfMessage):
            self._disarm()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 refused (and to what :class:`_Checked` refused): REST's JSON."""
        refusal = self.conn.refusal or http_framing.Refused(400, msg)
        if self.cycle is not None and not self.cycle.response_complete:  # a body refused: the app hears a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(refusal.answer())
        self._disarm()
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._lingering = LINGER_BYTES
            self._deadline = self.loop.call_later(LINGER_SECONDS, self._late)
        else:
            self.transport.close()
