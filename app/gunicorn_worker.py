"""gunicorn's threaded worker whose threads get only whole requests (the Procfile's ``--worker-class``).

gthread hands a connection to a thread as soon as it is accepted (or, kept alive, as soon as it
is readable), and the thread then blocks reading the request: a few clients that send half a
header block, promise a body they never send or announce an endless chunk hold every thread,
and nobody else is answered. Here the worker's own event loop (its selector, which already waits
on every kept-alive connection) reads each request first, without a thread, parsing its framing
with h11 (the library uvicorn uses): only once the head and the whole body are in (or the body is
known to be over ``MAX_BODY_BYTES``, which the app refuses without reading it) does a thread get
the connection, with those bytes already in gunicorn's buffer. A head not complete within
``HEAD_SECONDS`` of its first byte (or of the connection), a body not complete within
``BODY_SECONDS`` of its head, is closed without an answer, holding no thread meanwhile; what is
read ahead is bounded by gunicorn's head limits and the body limit. The head's lines are measured as
they come (``app/http_framing.py``): a request line, a header line or a count of headers over
gunicorn's limits is answered at once from the loop (414, 431, JSON, ``Connection: close``), as are a
line ended by a bare LF, a request with both Content-Length and Transfer-Encoding and a chunk line
ended by a bare LF (400), holding no thread; its client's late bytes are then read and dropped for a
while, so that it reads its answer. h11 gets the head only once it is whole: it is held once. A connection the thread
closes after an answer (``Connection: close``) lingers for the rest of the client's bytes in the
same loop, not on it (gunicorn's own lingering close blocks the loop for up to 2 s).

The parsing of record stays gunicorn's: a request h11 finds malformed is handed over as it came,
with no more time to read from the socket, and gunicorn answers it from what came
(``app/gunicorn_conf.py``'s JSON errors) or closes it; what a thread reads from the socket beyond
what was read ahead (a body over the limit the app does not read) it reads within ``BODY_SECONDS``.
Writing the answer is bounded too: the thread writes with the send timeout
(``VOICE_TOOLS_SEND_TIMEOUT``), and a client that does not take the answer in that time loses its
connection, reset. A connection's pipelined requests are answered one at a time, and one whose
last answer its client has not acknowledged (``TIOCOUTQ``) gets no more work: it waits in the loop,
holding no thread, until the answer is taken, and is reset past the send timeout.
With TLS or cleartext HTTP/2 configured in gunicorn itself (the Procfiles configure neither), the
worker reads nothing ahead: it is gthread as it comes.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import selectors
import socket
import struct
import termios
import time
from collections import deque
from typing import Any

import h11
from gunicorn.http.errors import ParseException
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, ThreadWorker, TConn
from werkzeug.exceptions import BadRequest

from app import http_framing
from app.limits import BODY_SECONDS, HEAD_SECONDS, MAX_BODY_BYTES
from models import settings

LINGER_SECONDS = 2.0  # gunicorn's close_graceful: how long a closed connection's late bytes are read and dropped
LINGER_BYTES = 64 * 1024
# after a refusal in the loop: what a client within the limits may still be sending (a head and a body),
# read and dropped so that it reads its answer rather than a reset
REFUSED_LINGER_BYTES = http_framing.MAX_HEAD_BYTES + MAX_BODY_BYTES
_drain_buffer = bytearray(65536)  # the loop's one buffer for the bytes it drops

log = logging.getLogger(__name__)


class _Reading:
    """One request being read ahead: its bytes as they came, the head's lines measured as they come
    (``app/http_framing.py``), and h11's view of the framing once the head is whole."""

    def __init__(self, started: float) -> None:
        self.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=http_framing.MAX_HEAD_BYTES)
        self.head: http_framing.HeadLimits | None = http_framing.HeadLimits()  # None once the head is whole
        self.data = bytearray()
        self.body = 0
        self.deadline = started + HEAD_SECONDS
        self.malformed = False
        self.waiting = False  # registered with the worker's selector

    def feed(self, data: bytes, sock: socket.socket) -> bool:
        """Take the bytes that came; True once the thread can have the request. A head over gunicorn's
        limits, a bare LF, a request with two framings: :class:`http_framing.Refused`, as soon as it shows."""
        self.data += data
        if self.head is not None:
            if self.head.feed(data) is None:
                return False  # h11 gets the head only once it is whole: it is held once, here
            self.head = None
            self.parser.receive_data(self.data)
        else:
            self.parser.receive_data(data)
        while True:
            try:
                event = self.parser.next_event()
            except h11.RemoteProtocolError:
                self.malformed = True  # gunicorn judges it from what came (and answers its own JSON error)
                return True
            http_framing.check(self.parser, event)
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return event is h11.PAUSED
            if isinstance(event, h11.Request):
                self.deadline = time.monotonic() + BODY_SECONDS
                length = _content_length(event.headers)
                if length is not None and length > MAX_BODY_BYTES:
                    return True  # refused by the app without reading it (413, Connection: close)
                if _expects_continue(event) and self.parser.their_state is h11.SEND_BODY:
                    _send_now(sock, b"HTTP/1.1 100 Continue\r\n\r\n")
            elif isinstance(event, h11.Data):
                self.body += len(event.data)
                if self.body > MAX_BODY_BYTES:
                    return True  # enough to know it is too large: the app refuses it
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return True


def _content_length(headers: Any) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return None


def _expects_continue(request: h11.Request) -> bool:
    return request.http_version == b"1.1" and any(
        name == b"expect" and value.lower() == b"100-continue" for name, value in request.headers)


def _send_now(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)
    except OSError:
        pass


class _Bounded:
    """The socket as gunicorn's reader of a request sees it: every read done by ``deadline``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + BODY_SECONDS

    def recv(self, size: int) -> bytes:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request's bytes did not come in time")
        before = self.sock.gettimeout()  # the answer's send timeout (WholeRequestWorker.handle_request)
        self.sock.settimeout(remaining if before is None else min(remaining, before))
        try:
            return self.sock.recv(size)
        finally:
            self.sock.settimeout(before)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class _Body:
    """gunicorn's reader of a request's body, as the app reads it (``wsgi.input``): a body whose framing
    gunicorn cannot parse (a chunk size that is not hex, chunk data without its CRLF, a bad chunk
    extension or trailer) is werkzeug's ``BadRequest``, which the app answers as any 400, in JSON."""

    def __init__(self, body: Any, malformed: list[bool]) -> None:
        self.body, self.malformed = body, malformed

    def _read(self, how: Any, *args: Any) -> Any:
        try:
            return how(*args)
        except ParseException as exc:
            self.malformed.append(True)
            raise BadRequest(f"The body's framing is malformed ({type(exc).__name__}).") from None

    def read(self, *args: Any) -> bytes:
        return self._read(self.body.read, *args)

    def readline(self, *args: Any) -> bytes:
        return self._read(self.body.readline, *args)

    def readlines(self, *args: Any) -> list[bytes]:
        return self._read(self.body.readlines, *args)

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line


def _malformed_bodies_are_400s(app: Any) -> Any:
    """The app, reading its body through :class:`_Body`: the answer to a malformed body says
    ``Connection: close`` (gunicorn reads no further from a body it cannot parse, and the client's
    next bytes must not be read as a request)."""

    def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
        malformed: list[bool] = []
        environ["wsgi.input"] = _Body(environ["wsgi.input"], malformed)

        def start(status: str, headers: list[tuple[str, str]], *exc_info: Any) -> Any:
            if malformed:
                headers = [(k, v) for k, v in headers if k.lower() != "connection"] + [("Connection", "close")]
            return start_response(status, headers, *exc_info)

        return app(environ, start)

    return wsgi


class _Conn(TConn):
    """gthread's connection, with the bytes read ahead for its thread, and its lingering close left to the loop."""

    def __init__(self, worker: "WholeRequestWorker", *args: Any) -> None:
        super().__init__(*args)
        self.worker = worker
        self.read_ahead: bytes | None = None
        self.malformed = False
        self.reset = False  # its client left an answer untaken: closed with a reset, nothing lingers

    def close(self, graceful: bool = False) -> None:
        if self.reset:
            _reset(self.sock)
            super().close()
        elif graceful:
            self.worker.linger(self.sock)
        else:
            super().close()


def _unacknowledged(sock: socket.socket) -> int:
    """Bytes written to ``sock`` its peer has not acknowledged yet (the kernel's send queue, ``TIOCOUTQ``)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def _reset(sock: socket.socket) -> None:
    """Make the close of ``sock`` a reset: the kernel drops what its peer left untaken, at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


class WholeRequestWorker(ThreadWorker):
    """gthread, each request read whole by the worker's event loop before a thread serves it."""

    def init_process(self) -> None:
        self.reading: dict[_Conn, _Reading] = {}
        self.lingering: deque[tuple[float, socket.socket]] = deque()
        self.drained: dict[socket.socket, int] = {}
        self.unread: dict[_Conn, float] = {}  # connections whose answers are untaken: their deadline
        self.send_timeout = settings.send_timeout_s()
        # plain HTTP/1 only: with TLS or HTTP/2 in gunicorn itself (not the Procfile's) it is gthread as it comes
        self.reads_ahead = not self.cfg.is_ssl and getattr(self.cfg, "http2_cleartext", "off") in (None, "off", "")
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = _malformed_bodies_are_400s(self.wsgi)

    def accept(self, listener: socket.socket) -> None:
        try:
            client_sock, client_addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        self.enqueue_req(_Conn(self, self.cfg, client_sock, client_addr, listener.getsockname()))

    def enqueue_req(self, conn: _Conn) -> None:
        """Every road to a thread (a new connection, a kept-alive one that became readable, bytes left
        after a request) reads the request first; the thread gets it when it is whole."""
        if conn.read_ahead is not None or not self.reads_ahead:
            super().enqueue_req(conn)
            return
        if _unacknowledged(conn.sock):  # its client has not taken the last answer: no more work for it yet
            self.unread.setdefault(conn, time.monotonic() + self.send_timeout)
            return
        self.unread.pop(conn, None)
        reading = _Reading(time.monotonic())
        left = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        conn.sock.setblocking(False)
        self.reading[conn] = reading
        if left:
            self._take(conn, left)
        else:  # a kept-alive connection comes here readable: its bytes are read now, not one poll later
            self._readable(conn)
        if conn in self.reading:  # more to come
            self.poller.register(conn.sock, selectors.EVENT_READ, lambda _sock, conn=conn: self._readable(conn))
            reading.waiting = True

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(conn)
            return
        self._take(conn, data)

    def _take(self, conn: _Conn, data: bytes) -> None:
        reading = self.reading[conn]
        try:
            whole = reading.feed(data, conn.sock)
        except http_framing.Refused as refused:
            self._refuse(conn, refused)
            return
        except Exception:  # noqa: BLE001 - one connection's surprise never ends the worker's loop
            log.exception("reading a request ahead failed; its connection is closed")
            self._drop(conn)
            return
        if whole:
            del self.reading[conn]
            if reading.waiting:
                self.poller.unregister(conn.sock)
            self._hand_over(conn, reading)

    def _hand_over(self, conn: _Conn, reading: _Reading) -> None:
        conn.read_ahead, conn.malformed = bytes(reading.data), reading.malformed
        conn.data_ready = True  # gthread would otherwise wait for bytes that are already read
        super().enqueue_req(conn)

    def _forget(self, conn: _Conn) -> None:
        self.reading.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self.nr_conns -= 1

    def _drop(self, conn: _Conn) -> None:
        self._forget(conn)
        TConn.close(conn)

    def _refuse(self, conn: _Conn, refused: http_framing.Refused) -> None:
        """Answer a request its framing refuses (JSON, ``Connection: close``) from the loop, no thread
        taken, and close its connection once the client's late bytes are dropped (it reads its answer)."""
        self._forget(conn)
        _send_now(conn.sock, refused.answer())
        self.linger(conn.sock, REFUSED_LINGER_BYTES)

    def handle(self, conn: _Conn) -> Any:  # on a thread
        data, conn.read_ahead = conn.read_ahead, None
        if data is not None:
            try:
                conn.sock.setblocking(True)
                conn.init()
            except OSError:
                return False
            unreader = conn.parser.unreader
            if not isinstance(getattr(unreader, "sock", None), _Bounded):
                unreader.sock = _Bounded(unreader.sock)
            unreader.sock.deadline = time.monotonic() + (0 if conn.malformed else BODY_SECONDS)
            unreader.unread(data)
        return super().handle(conn)

    def handle_request(self, req: Any, conn: _Conn) -> Any:  # on a thread
        """gthread's, with the answer's writes bounded as its reads are: a client that does not take the
        answer within the send timeout (``VOICE_TOOLS_SEND_TIMEOUT``) loses its connection, reset."""
        if not self.reads_ahead:
            return super().handle_request(req, conn)
        conn.sock.settimeout(self.send_timeout)
        try:
            return super().handle_request(req, conn)
        except TimeoutError:  # its answer untaken (or the rest of its body unsent) in time
            log.info("a client did not take its answer in %.0f s: its connection is reset", self.send_timeout)
            conn.reset = True
            return False

    def murder_pending(self) -> None:
        """gthread's sweep of connections waiting for bytes, with the requests read ahead past their time,
        the connections whose answers are untaken (read from once taken, reset past the send timeout) and
        the lingering closes past theirs."""
        super().murder_pending()
        now = time.monotonic()
        if not self.alive:  # stopping: a request on its way has as long as a kept-alive connection has
            for reading in self.reading.values():
                reading.deadline = min(reading.deadline, now + STOP_KEEPALIVE_LINGER)
        for conn in [conn for conn, reading in self.reading.items() if reading.deadline <= now]:
            self._drop(conn)
        for conn, deadline in list(self.unread.items()):
            if not _unacknowledged(conn.sock):
                self.enqueue_req(conn)  # taken: its next request is read
            elif deadline <= now or not self.alive:
                del self.unread[conn]
                conn.reset = True
                self.nr_conns -= 1
                conn.close()
        while self.lingering and self.lingering[0][0] <= now:
            self._end_linger(self.lingering.popleft()[1])

    # -- closing after an answer: the client's late bytes read and dropped by the loop -------------

    def linger(self, sock: socket.socket, budget: int = LINGER_BYTES) -> None:
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self.poller.register(sock, selectors.EVENT_READ, self._drain)
        except (OSError, ValueError, KeyError):
            self._end_linger(sock)
            return
        self.drained[sock] = budget  # bytes still to be read and dropped
        self.lingering.append((time.monotonic() + LINGER_SECONDS, sock))

    def _drain(self, sock: socket.socket) -> None:
        try:
            read = sock.recv_into(_drain_buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            read = 0
        self.drained[sock] = self.drained.get(sock, 0) - read
        if not read or self.drained[sock] <= 0:
            self._end_linger(sock)

    def _end_linger(self, sock: socket.socket) -> None:
        self.drained.pop(sock, None)
        try:
            self.poller.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            sock.close()
        except OSError:
            pass
