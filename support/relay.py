"""A relay stand-in: a real local HTTP server that receives callbacks.

It checks every request's signature (``tasks.delivery.signing.verify``, and
``verify_standard`` too when it is given ``webhook_secrets``: a bad one is answered 401 and
counted in ``bad_signatures``), records the events in order with when each one's body was read
(``arrived``), and answers as programmed: ``relay.answer(lambda event: {...})`` returns the JSON to send
back (or an int status, or ``None`` for ``{"received": true}``); ``relay.delay`` makes it
slow; ``relay.down()`` closes its port (a connection is refused) and ``relay.up()``
listens on it again.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from tasks.delivery.signing import verify, verify_standard


class Relay:
    def __init__(self, secret: str, webhook_secrets: list[str] | None = None, host: str = "127.0.0.1",
                 port: int = 0):
        """Listening on ``host:port`` (any free port by default; another host's address in the multi-host test)."""
        self.secret = secret
        self.host = host
        self.webhook_secrets = webhook_secrets or []  # Standard Webhooks secrets: checked too when given
        self.events: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.bodies: list[bytes] = []  # the raw body of each event, beside ``events`` (what was signed)
        self.paths: list[str] = []  # the path each event was posted to, beside ``events``
        self.arrived: list[float] = []  # when each event's body was read (``time.time()``), beside ``events``
        self.bad_signatures = 0
        self.delay = 0.0
        self._answer: Callable[[dict[str, Any]], Any] = lambda event: None
        self._lock = threading.Condition()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                read_at = time.time()
                if not verify(relay.secret, self.headers, body) or (
                        relay.webhook_secrets and not verify_standard(relay.webhook_secrets, self.headers, body)):
                    with relay._lock:
                        relay.bad_signatures += 1
                    self._reply(401, {"error": "bad signature"})
                    return
                event = json.loads(body)
                if relay.delay:
                    time.sleep(relay.delay)
                answer = relay._answer(event)
                with relay._lock:
                    relay.events.append(event)
                    relay.headers.append(dict(self.headers))
                    relay.bodies.append(body)
                    relay.paths.append(self.path)
                    relay.arrived.append(read_at)
                    relay._lock.notify_all()
                if isinstance(answer, int):
                    self._reply(answer, {"error": "programmed failure"})
                else:
                    self._reply(200, answer if answer is not None else {"received": True})

            def _reply(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the sender gave up waiting (a slow relay): it was received all the same

        self._handler = Handler
        self._listen(port)
        self.url = f"http://{host}:{self.server.server_address[1]}/tool-progress"

    def _listen(self, port: int) -> None:
        self.server = ThreadingHTTPServer((self.host, port), self._handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Relay":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            self.down()

    def down(self) -> None:
        """Stop listening: every delivery is refused until :meth:`up`."""
        self.server.shutdown()
        self.server.server_close()
        self.server = None

    def up(self) -> None:
        """Listen again on the same port."""
        self._listen(int(self.url.split(":")[2].split("/")[0]))
        self._thread.start()

    def answer(self, fn: Callable[[dict[str, Any]], Any]) -> None:
        self._answer = fn

    @property
    def base(self) -> str:
        """``http://<host>:<port>``: any path on it reaches this relay (``/tool-checkpoint``, ...)."""
        return self.url.rsplit("/", 1)[0]

    def events_at(self, tool_call_id: str) -> list[tuple[str, str]]:
        """``(path, event)`` of each of the call's events, in arrival order."""
        with self._lock:
            return [(p, e["event"]) for p, e in zip(self.paths, self.events) if e["tool_call_id"] == tool_call_id]

    def events_for(self, tool_call_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["tool_call_id"] == tool_call_id]

    def wait_for(self, tool_call_id: str, event: str, timeout: float = 15.0) -> dict[str, Any]:
        """Block until ``event`` arrives for the call; return it (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for e in self.events:
                    if e["tool_call_id"] == tool_call_id and e["event"] == event:
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(e["event"], e.get("step")) for e in self.events if e["tool_call_id"] == tool_call_id]
                    raise AssertionError(f"no {event!r} event for {tool_call_id} within {timeout}s; saw {seen}")
                self._lock.wait(left)
