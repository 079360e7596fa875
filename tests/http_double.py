"""A real local HTTP server that stands in for Google's and OpenAI's APIs in tests.

The product's real client libraries (googleapiclient, openai) talk to it over HTTP,
pointed at it by configuration (``VOICE_TOOLS_GOOGLE_API_ENDPOINT``,
``OPENAI_BASE_URL``), so it works from any process: an in-process worker or a
prefork worker the test SIGKILLs. Nothing of ours is mocked.

A test scripts answers per route, in order, and reads back what was asked::

    with HttpDouble() as api:
        api.answer("POST", r"/calendar/v3/freeBusy", {"calendars": {...}})
        api.answer("POST", r"/calendar/v3/calendars/primary/events", {"error": ...}, status=503)
        ...
        assert api.requests_to("POST", r"/events")[0].json["id"] == ...

A body function may return a :class:`Reply` to choose the status as well (a stateful
double: ``tests/google_fixtures.py``). Each ``answer`` is used once, in the order given for
its route; the last one given for a route repeats (``times=None`` makes it repeat from the
start). A request that no route matches is answered 599 and recorded, so a test sees it.
``delay`` holds an answer back (a slow or hung service).
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body or b"null")


@dataclass
class Reply:
    """What a body function answers when the status depends on the request (404 for a draft gone)."""

    status: int
    body: Any


@dataclass
class _Answer:
    status: int
    body: Any
    headers: dict[str, str]
    delay: float
    repeat: bool


@dataclass
class _Route:
    method: str
    pattern: re.Pattern[str]
    answers: list[_Answer] = field(default_factory=list)
    used: int = 0


Body = Any | Callable[[Request], Any]


class HttpDouble:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listening on ``host:port`` (any free port by default; a container network's gateway, for
        processes in containers, at a port chosen before they start)."""
        self.requests: list[Request] = []
        self._routes: list[_Route] = []
        self._lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                parts = urlsplit(self.path)
                request = Request(self.command, parts.path, parse_qs(parts.query),
                                  {k.lower(): v for k, v in self.headers.items()}, self.rfile.read(length))
                answer = double._take(request)
                if answer.delay:
                    time.sleep(answer.delay)
                body = answer.body(request) if callable(answer.body) else answer.body
                status = answer.status
                if isinstance(body, Reply):
                    status, body = body.status, body.body
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                headers = {"Content-Type": "application/json", **answer.headers}
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                try:
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):  # the client died (worker-loss tests)
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "HttpDouble":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, method: str, path: str, body: Body = None, status: int = 200, *,
               headers: dict[str, str] | None = None, delay: float = 0.0, times: int | None = 1) -> "HttpDouble":
        """Answer ``method`` on paths matching the regex ``path`` (searched) with ``body``.

        ``body`` may be a function of the :class:`Request`. ``times=None`` repeats this
        answer for every later request of the route.
        """
        with self._lock:
            route = next((r for r in self._routes if r.method == method and r.pattern.pattern == path), None)
            if route is None:
                route = _Route(method, re.compile(path))
                self._routes.append(route)
            for _ in range(times or 1):
                route.answers.append(_Answer(status, body, headers or {}, delay, repeat=times is None))
        return self

    def _take(self, request: Request) -> _Answer:
        with self._lock:
            self.requests.append(request)
            for route in self._routes:
                if route.method == request.method and route.pattern.search(request.path):
                    if route.used < len(route.answers):
                        answer = route.answers[route.used]
                        if not answer.repeat:
                            route.used += 1
                        return answer
                    return route.answers[-1]
        return _Answer(599, {"error": f"no answer scripted for {request.method} {request.path}"}, {}, 0.0, False)

    def requests_to(self, method: str, path: str) -> list[Request]:
        """The requests made so far to ``method`` on paths matching the regex ``path``."""
        with self._lock:
            return [r for r in self.requests if r.method == method and re.search(path, r.path)]
