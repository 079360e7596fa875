"""One set of HTTP/1.1 framing rules for both ports (REST's gunicorn worker, the MCP face's uvicorn),
applied as the bytes come, before any parser buffers a head, and the JSON answer of a refusal.

- :class:`HeadLimits`: gunicorn's own limits (``app.limits``, set in ``app/gunicorn_conf.py``) on a head,
  counted as its bytes come, keeping none of them: a request line over ``MAX_REQUEST_LINE`` bytes is a
  414, a header line over ``MAX_HEADER_BYTES`` (with its CRLF) or more than ``MAX_HEADER_FIELDS``
  headers a 431, a line ended by a bare LF a 400 (RFC 9112 section 2.2; gunicorn refuses it too). gunicorn
  measures a header line only once the whole head is in, up to about 800 KB: here one never-ending line
  is refused at its 8,190th byte.
- :func:`check`: what h11 (the parser both ports read framing with) lets through and gunicorn does not:
  a request with both Content-Length and Transfer-Encoding (RFC 9112 section 6.1: refused, its connection
  closed), and a chunk line ended by a bare LF or over ``MAX_HEADER_BYTES`` (h11 and gunicorn would wait
  for a CRLF that never comes).
- :func:`answer`: the whole HTTP answer of a refusal, JSON ``{error, message, details}`` as every answer
  of the API, ``Connection: close``; :func:`body` its body (the MCP face's answers its app gives in plain
  text get it too).
"""
from __future__ import annotations

import json
import re
from typing import Any

import h11

from app.limits import MAX_HEADER_BYTES, MAX_HEADER_FIELDS, MAX_REQUEST_LINE

# the longest head gunicorn could accept (its parser's bound, and h11's on both ports)
MAX_HEAD_BYTES = MAX_REQUEST_LINE + 2 + MAX_HEADER_FIELDS * (MAX_HEADER_BYTES + 2) + 2

_BARE_LF = re.compile(rb"(?<!\r)\n")

# a status: the code and message of the JSON error, and what details say of the limits
ERRORS: dict[int, tuple[str, str, dict[str, Any]]] = {
    400: ("bad_request", "The request is not valid HTTP.", {}),
    401: ("unauthorized", "Send Authorization: Bearer <token>.", {}),
    403: ("forbidden", "This request is forbidden.", {}),
    404: ("not_found", "No such endpoint.", {}),
    405: ("method_not_allowed", "This method is not allowed here.", {}),
    406: ("not_acceptable", "The Accept header names no type this endpoint answers.", {}),
    408: ("request_timeout", "The request did not come in time.", {}),
    413: ("too_large", "The body is too large.", {}),
    414: ("uri_too_long", f"The request line is longer than {MAX_REQUEST_LINE} bytes.",
          {"max_bytes": MAX_REQUEST_LINE}),
    417: ("expectation_failed", "The Expect header is not supported.", {}),
    415: ("unsupported_media_type", "The body's Content-Type is not one this endpoint reads.", {}),
    431: ("headers_too_large",
          f"A header is longer than {MAX_HEADER_BYTES} bytes or there are more than {MAX_HEADER_FIELDS} headers.",
          {"max_header_bytes": MAX_HEADER_BYTES, "max_headers": MAX_HEADER_FIELDS}),
    500: ("internal_error", "Something went wrong on our side.", {}),
    501: ("not_implemented", "This transfer coding is not supported.", {}),
}
REASONS = {400: "Bad Request", 414: "URI Too Long", 431: "Request Header Fields Too Large",
           501: "Not Implemented"}


def body(status: int, reason: str, mesg: str = "") -> bytes:
    """The JSON body of a refusal of ``status`` (``mesg``: what was wrong, in details)."""
    error, message, details = ERRORS.get(status, (reason.lower().replace(" ", "_"), f"{reason}.", {}))
    details = {**details, "reason": mesg[:300]} if mesg else dict(details)
    return json.dumps({"error": error, "message": message, "details": details}).encode()


def answer(status: int, reason: str, mesg: str = "") -> bytes:
    """The whole HTTP answer of a refusal made before the app."""
    body_ = body(status, reason, mesg)
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body_)}\r\n\r\n")
    return head.encode("latin-1") + body_


class Refused(Exception):
    """A request refused by its framing: ``status`` and what was wrong (never the client's bytes)."""

    def __init__(self, status: int, mesg: str) -> None:
        super().__init__(mesg)
        self.status, self.mesg = status, mesg

    def answer(self) -> bytes:
        return answer(self.status, REASONS.get(self.status, "Bad Request"), self.mesg)


class HeadLimits:
    """A head's lines measured as its bytes come (none kept): :meth:`feed` says where the head ends, or
    raises :class:`Refused` as soon as a line is over its limit, however much of it is still to come."""

    def __init__(self) -> None:
        self.line = 0  # lines ended so far (the request line is the first; one empty line before it is allowed)
        self.blank_skipped = False
        self.length = 0  # bytes of the line under way, a CR that may end it included
        self.cr = False  # its last byte is a CR
        self.first = b""  # its first byte (a space or tab: a continuation, not a field)
        self.fields = 0

    def feed(self, data: bytes) -> int | None:
        """The index in ``data`` just past the head's end (its empty line), or None while it goes on."""
        pos = 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            end = len(data) if nl < 0 else nl
            if end > pos:
                if not self.length:
                    self.first = data[pos:pos + 1]
                self.length += end - pos
                self.cr = data[end - 1] == 13
            if nl < 0:
                self._measure(self.length - self.cr)
                return None
            if not self.cr:
                raise Refused(400, "bare LF as line terminator")
            if self._ended(self.length - 1):
                return nl + 1
            self.length, self.cr, self.first = 0, False, b""
            pos = nl + 1
        return None

    def _measure(self, length: int) -> None:
        """A line (without its CRLF) of ``length`` bytes so far: refused once it cannot fit."""
        if self.line == 0:
            if length > MAX_REQUEST_LINE:
                raise Refused(414, f"Request Line is too large ({length} > {MAX_REQUEST_LINE})")
        elif length + 2 > MAX_HEADER_BYTES:
            raise Refused(431, "Error parsing headers: 'limit request headers fields size'")

    def _ended(self, length: int) -> bool:
        """A line ended: True if it is the head's last (the empty line after the headers)."""
        if self.line == 0 and length == 0 and not self.blank_skipped:
            self.blank_skipped = True  # RFC 9112 section 2.2: one empty line before the request line
            return False
        self._measure(length)
        self.line += 1
        if self.line == 1:
            return False
        if length == 0:
            return True
        if self.first not in (b" ", b"\t"):
            self.fields += 1
            if self.fields > MAX_HEADER_FIELDS:
                raise Refused(431, "Error parsing headers: 'limit request headers fields'")
        return False


def check(parser: h11.Connection, event: Any) -> None:
    """Raise :class:`Refused` for what h11 accepts and REST's gunicorn refuses (see the module's text);
    ``event`` is what ``parser.next_event()`` just gave."""
    if isinstance(event, h11.Request):
        names = {name for name, _ in event.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise Refused(400, "both Content-Length and Transfer-Encoding")
    elif event is h11.NEED_DATA and parser.their_state is h11.SEND_BODY:
        # a chunked body's next line under way: h11 keeps only what it has not parsed (nothing, in a body
        # read by Content-Length or inside a chunk's data), and waits for a CRLF
        pending, _ = parser.trailing_data
        if pending:
            if _BARE_LF.search(pending):
                raise Refused(400, "bare LF as line terminator in a chunked body")
            if len(pending) > MAX_HEADER_BYTES and b"\n" not in pending:
                raise Refused(400, f"a chunk line over {MAX_HEADER_BYTES} bytes")
