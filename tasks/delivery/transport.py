"""The HTTP side of a callback: one pooled session per process (made again after a fork), one
attempt's exchange bounded as a whole.

Redirects are not followed. A watchdog ends the exchange at the timeout (a relay that
drips a byte a second does not hold the link), and at most ``MAX_ANSWER_BYTES`` of the
answer are read (a longer answer counts as no answer). An answer read whole is a delivery
even when the deadline passed as it was read (the relay has the event: sending it again
would only make a duplicate). The connection goes to the
address the URL check approved (``tasks/delivery/url_policy.py``), with no second DNS
answer in between: the name stays in the Host header and, for https, in SNI and the
certificate check; a pooled connection to another address is not reused. The environment's
proxies (``HTTP_PROXY``, ...) are not read; ``VOICE_TOOLS_CALLBACK_PROXY`` is the only one. With
tracing on, the exchange is a span whose ``traceparent`` and ``tracestate`` the request carries
(``voice_tools_tracing/callbacks.py``).
"""
from __future__ import annotations

import heapq
import os
import socket
import threading
import time
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import ProxyManager

from voice_tools_tracing import callbacks as tracing

_http: requests.Session | None = None

MAX_ANSWER_BYTES = 64 * 1024  # more than any {"cancel": true, "reason": ...}; a longer answer is no answer
_local = threading.local()  # this thread's attempt: its watchdog and the address checked for its host


class _Watchdog:
    """One thread per process that ends attempts at their deadlines (a thread started per
    attempt costs a thread start on the caller's clock). Started lazily, so a forked
    child makes its own."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, "_Watch"]] = []
        self._count = 0
        self._pid = 0

    def add(self, watch: "_Watch", seconds: float) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use in this process (or after a fork)
                self._pid, self._due = os.getpid(), []
                threading.Thread(target=self._run, name="callback-watchdog", daemon=True).start()
            self._count += 1
            due = (time.monotonic() + seconds, self._count, watch)
            heapq.heappush(self._due, due)
            if self._due[0] is due:  # the thread already wakes by an earlier deadline: leave it asleep
                self._cond.notify()

    def _run(self) -> None:
        pid = os.getpid()
        with self._cond:
            while self._pid == pid:
                now = time.monotonic()
                while self._due and (self._due[0][2].done or self._due[0][0] <= now):
                    _, _, watch = heapq.heappop(self._due)
                    if not watch.done:
                        watch.fire()
                self._cond.wait(self._due[0][0] - now if self._due else None)


_watchdog = _Watchdog()


def _fresh_after_fork() -> None:
    """A forked child (a Celery pool process, a gunicorn worker) makes its own HTTP session and
    watchdog: it never shares its parent's connections, nor a lock the parent's watchdog thread held."""
    global _http, _watchdog
    _http = None
    _watchdog = _Watchdog()


os.register_at_fork(after_in_child=_fresh_after_fork)


class _Watch:
    """Ends one attempt's exchange at its deadline: shuts the connection's socket down,
    which ends a read however slowly the relay drips (a socket timeout is per read)."""

    def __init__(self, seconds: float):
        self._lock = threading.Lock()
        self._conn: HTTPConnection | None = None
        self._seconds = seconds
        self.done = False
        self.fired = False

    def attach(self, conn: HTTPConnection) -> None:
        with self._lock:
            self._conn = conn
            if self.fired:
                self._shut()

    def fire(self) -> None:
        with self._lock:
            if not self.done:
                self.fired = True
                self._shut()

    def settle(self) -> bool:
        """The answer is read (to its end, or to the byte limit): from now on the deadline leaves the
        connection alone. Returns whether the deadline had already cut it."""
        with self._lock:
            self.done = True
            return self.fired

    def _shut(self) -> None:
        sock = getattr(self._conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "_Watch":
        _local.watch = self
        _watchdog.add(self, self._seconds)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self.done = True  # the watchdog drops it when it next looks
        _local.watch = None


class _Watched:
    """A pooled connection that its attempt's watchdog can end, and that connects to
    the address the delivery checks approved (no second DNS answer in between)."""

    def request(self, *args: Any, **kwargs: Any) -> None:
        watch = getattr(_local, "watch", None)
        if watch is not None:
            watch.attach(self)  # type: ignore[arg-type]
        pin = getattr(_local, "pin", None)
        if pin is not None and pin[0] == self._dns_host and self._peer() not in (None, pin[1]):  # type: ignore[attr-defined]
            self.close()  # type: ignore[attr-defined]  # kept alive to another address: connect again, to the pin
        return super().request(*args, **kwargs)  # type: ignore[misc]

    def _peer(self) -> str | None:
        """The address this pooled connection is connected to, or None if it is not connected."""
        sock = getattr(self, "sock", None)
        if sock is None:
            return None
        try:
            return sock.getpeername()[0].split("%")[0]
        except OSError:
            return ""  # connected once, gone now: connect again

    def _new_conn(self) -> socket.socket:
        pin = getattr(_local, "pin", None)
        name = self._dns_host  # type: ignore[attr-defined]
        if pin is None or pin[0] != name:
            return super()._new_conn()  # type: ignore[misc]
        self._dns_host = pin[1]
        try:
            return super()._new_conn()  # type: ignore[misc]
        finally:
            self._dns_host = name


class _HTTPConnection(_Watched, HTTPConnection):
    pass


class _HTTPSConnection(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class _Adapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        """Through the callback proxy (``VOICE_TOOLS_CALLBACK_PROXY``) the watchdog still bounds the attempt
        (the proxy resolves the name)."""
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if type(manager) is ProxyManager:  # a SOCKS manager keeps its own connections
            manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
        return manager


def http() -> requests.Session:
    global _http
    if _http is None:
        session = requests.Session()
        session.trust_env = False  # no HTTP(S)_PROXY, NO_PROXY or .netrc from the environment
        session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
        adapter = _Adapter(pool_connections=20, pool_maxsize=20, max_retries=0)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        session.headers["User-Agent"] = "voice-tools-callbacks/1"
        _http = session
    return _http


def _framed(response: requests.Response) -> bool:
    """Whether the answer says where it ends (a Content-Length, chunks), so that reading it to that end
    proves it whole; an answer that ends with its connection cannot tell the relay's end from the cut."""
    return bool(response.raw.chunked) or response.raw.length_remaining is not None


def exchange(url: str, body: bytes, headers: dict[str, str], timeout: float,
             pin: tuple[str, str] | None, proxy: str | None = None) -> tuple[int | None, str | None, bytes, str | None]:
    """One request and its answer, all of it within ``timeout`` seconds and ``MAX_ANSWER_BYTES``.

    ``pin``: (host name, the address checked for it) to connect to; ``proxy``: the callback
    proxy, the only hop when set.

    Returns (status code, error or None, the answer's bytes of a 2xx, a note). A 2xx
    whose answer is longer than the limit is delivered with no answer (noted). A 2xx read whole is
    delivered even when the deadline passed as it was read: the relay has the event.
    """
    code: int | None = None
    error: str | None = None
    raw = b""
    note: str | None = None
    complete = False  # a 2xx answer read whole (or to the limit), whenever the deadline came
    _local.pin = pin
    try:
        with tracing.posting(url, headers) as span, _Watch(timeout) as watch:  # traceparent: the span's, if tracing
            try:
                response = http().post(url, data=body, headers=headers, timeout=(timeout, timeout),
                                       allow_redirects=False, stream=True,
                                       proxies={"http": proxy, "https": proxy} if proxy else {})
                try:
                    code = response.status_code
                    if 200 <= code < 300:
                        chunks, size = [], 0
                        for chunk in response.iter_content(16384):
                            chunks.append(chunk)
                            size += len(chunk)
                            if size > MAX_ANSWER_BYTES:
                                note = f"answer over {MAX_ANSWER_BYTES} bytes: read as no answer"
                                break
                        cut = watch.settle()
                        # the relay's own bytes settled it: the answer's framing says it is whole (the cut
                        # only ends a read, and a framed answer ended early raises), or it is over the limit
                        complete = not cut or note is not None or _framed(response)
                        raw = b"" if note else b"".join(chunks)
                    else:
                        error = f"HTTP {code}"
                finally:
                    response.close()  # a connection left mid-answer is closed, not pooled
            except requests.RequestException as exc:
                error = f"{type(exc).__name__}: {exc}"[:500]
            if watch.fired and not complete:  # whatever the cut connection raised, the truth is the deadline
                error, raw, note = f"Timeout: no complete answer within {timeout:g} s", b"", None
            tracing.answered(span, code, error)
    finally:
        _local.pin = None
    return code, error, raw, note
