"""One delivery attempt, hardened: the whole exchange is bounded
in time and bytes, so a slow-drip relay never fails a call; the URL is checked again at
delivery (the allowlist of the moment, never this system's own ports on a local address,
a host name resolved and refused if it points inside); nothing is sent unsigned."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from models import db
from models.calls import CallbackDelivery
from tasks.calls import actions
from tasks.delivery import attempts
from tasks.delivery import transport
from tasks.delivery import url_policy
from tests.helpers import deliveries, delivery, make_call, progress_event, row, wait_delivered, wait_status

DRIP_BYTES, DRIP_EVERY = 100, 0.2  # 20 s in all, yet every read gets a byte well within the 1 s timeout


def read_request(conn: socket.socket, pending: bytes = b"") -> bytes | None:
    """Read one request (its head, and a body of its Content-Length) from ``conn``, starting with the
    ``pending`` bytes; the bytes that came after it, or None when the client hung up first."""
    data = pending
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += conn.recv(65536)
    return rest[length:]


class DripServer:
    """A relay that answers its first ``drip`` requests slowly (in the status line
    or in the body): a byte every DRIP_EVERY seconds, and every later one at once with ``{"received": true}``.

    ``cut`` is set when the client hung up mid-drip; ``dripped`` counts the bytes it got out.
    """

    def __init__(self, where: str, drip: int = 1):
        self.where, self.drip = where, drip
        self.requests = 0
        self.dripped: list[int] = []
        self.cut = threading.Event()
        self._stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/tool-progress"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            while True:  # one request after another on a kept-alive connection
                if read_request(conn) is None:
                    return
                self.requests += 1
                if self.requests > self.drip:
                    body = b'{"received": true}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    continue
                if self.where == "status":
                    first, slow = b"", b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"x" * DRIP_BYTES
                else:
                    first = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % DRIP_BYTES
                    slow = b" " * DRIP_BYTES
                sent = 0
                try:
                    conn.sendall(first)
                    for byte in slow:
                        conn.sendall(bytes([byte]))
                        sent += 1
                        if self._stop.wait(DRIP_EVERY):
                            return
                except OSError:
                    self.cut.set()
                    return
                finally:
                    self.dripped.append(sent)
                return

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


class CountingServer:
    """Counts requests and answers each with ``body`` (200)."""

    def __init__(self, body: bytes = b'{"received": true}'):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/cb"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[Any] = []

    def _make(cls: type, *args: Any) -> Any:
        made.append(cls(*args))
        return made[-1]

    yield _make
    for server in made:
        server.close()








def seconds_to_first_attempt(found: CallbackDelivery) -> float:
    """From the event's insert to the end of its first recorded attempt (the database's and this machine's clocks)."""
    return (datetime.fromisoformat(found.attempt_log[0]["at"]) - found.created_at).total_seconds()


# -- a slow-drip relay ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("where", ["status", "body"])
def test_a_drip_is_cut_at_the_timeout_and_the_retry_delivers(servers, monkeypatch, where):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "1")
    drip = servers(DripServer, where)
    tool_call_id, event_id = progress_event(drip.url)
    answer = attempts.attempt(event_id)
    assert (answer.attempted, answer.delivered, answer.cancel) == (True, False, False)
    assert drip.cut.wait(10), "the relay was not hung up on"
    assert drip.dripped and drip.dripped[0] < 30  # the link stopped listening after a few bytes, not 100
    found = delivery(event_id)
    assert (found.state, found.attempts) == ("pending", 1)
    assert found.last_error == "Timeout: no complete answer within 1 s"
    assert seconds_to_first_attempt(found) < 1 + 5  # the timeout plus slack, not the minute of the drip
    assert row(tool_call_id).status == "EXECUTING"
    # The next attempt (the relay answers at once now) delivers the same event.
    with db.session() as s:
        s.execute(CallbackDelivery.__table__.update().where(CallbackDelivery.event_id == event_id)
                  .values(next_attempt_at=None))
    assert attempts.attempt(event_id).delivered
    done = delivery(event_id)
    assert (done.state, done.attempts, done.response_code, done.last_error) == ("delivered", 2, 200, None)
    assert drip.requests == 2


@pytest.mark.slow
def test_a_drip_relay_never_fails_the_call_and_gets_its_event_by_retry(worker, servers, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "1")
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_RETRY_TIMEOUT", "5")
    drip = servers(DripServer, "body")
    call = make_call(callback_url=drip.url)
    actions.confirm(call.tool_call_id)
    # The first event drips for 20 s; the chain went on (a held link would hit its time limit).
    wait_status(call.tool_call_id, "PREPARED", timeout=30)
    actions.resume(call.tool_call_id)
    done_call = wait_status(call.tool_call_id, "COMPLETED", timeout=30)
    assert done_call.error_message is None
    first = deliveries(call.tool_call_id)[0]
    assert first.event == "progress"
    done = wait_delivered(first.event_id)  # by the callbacks queue's retry
    assert done.attempts == 2 and done.attempt_log[0]["error"] == "Timeout: no complete answer within 1 s"
    assert done.attempt_log[1]["response_code"] == 200 and done.attempt_log[1]["error"] is None
    assert seconds_to_first_attempt(done) < 1 + 5
    assert drip.cut.wait(10) and drip.dripped[0] < 30
    for later in deliveries(call.tool_call_id)[1:]:
        assert wait_delivered(later.event_id).attempts == 1


@pytest.mark.slow
def test_a_drip_through_the_callback_proxy_is_cut_too(servers, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "1")
    proxy = servers(DripServer, "status")  # the proxy drips its answer
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_PROXY", proxy.url.rsplit("/", 1)[0])
    _, event_id = progress_event("http://127.0.0.1:9/cb")  # the relay itself is never reached: the proxy is
    assert not attempts.attempt(event_id).delivered
    assert proxy.requests == 1 and proxy.cut.wait(10) and proxy.dripped[0] < 30
    found = delivery(event_id)
    assert found.last_error == "Timeout: no complete answer within 1 s"
    assert seconds_to_first_attempt(found) < 1 + 5


def test_an_answer_over_64_kib_is_no_answer(servers):
    big = json.dumps({"cancel": True, "reason": "stop", "pad": "x" * (transport.MAX_ANSWER_BYTES + 1000)}).encode()
    server = servers(CountingServer, big)
    tool_call_id, event_id = progress_event(server.url)
    answer = attempts.attempt(event_id)
    assert (answer.delivered, answer.cancel) == (True, False)
    assert row(tool_call_id).status == "EXECUTING"  # the cancel inside it was not read
    found = delivery(event_id)
    assert (found.state, found.response_code, found.last_error) == ("delivered", 200, None)
    assert found.attempt_log[0]["note"] == f"answer over {transport.MAX_ANSWER_BYTES} bytes: read as no answer"


def test_the_same_cancel_under_64_kib_cancels(servers):
    """The control for the test above: only the size differs."""
    small = json.dumps({"cancel": True, "reason": "stop", "pad": "x" * 1000}).encode()
    tool_call_id, event_id = progress_event(servers(CountingServer, small).url)
    assert attempts.attempt(event_id).cancel is True
    assert row(tool_call_id).status == "CANCELLED"
    assert "note" not in delivery(event_id).attempt_log[0]


# -- an answer at the deadline -------------------------------------------------------------

class FramedRelay:
    """A relay that answers each request ``{"received": true}`` ``answer_after`` seconds after it came,
    framed as ``framing`` says: ``length`` (Content-Length), ``chunked``, or ``close`` (the answer
    ends when the connection does, and this relay never ends it). ``hung_up`` is set when the
    client closes or cuts the connection."""

    BODY = b'{"received": true}'

    def __init__(self, framing: str, answer_after: float = 0.0):
        self.framing, self.answer_after = framing, answer_after
        self.requests = 0
        self.hung_up = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.url = f"{self.base}/tool-progress"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _answer(self) -> bytes:
        if self.framing == "length":
            return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY)
        if self.framing == "chunked":
            return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
                len(self.BODY), self.BODY)
        return b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + self.BODY

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            after: bytes | None = b""
            while True:  # one request after another on a kept-alive connection
                after = read_request(conn, after)
                if after is None:
                    self.hung_up.set()
                    return
                self.requests += 1
                time.sleep(self.answer_after)
                conn.sendall(self._answer())

    def close(self) -> None:
        self.sock.close()


def pause_the_sender(monkeypatch, method: str, relay: FramedRelay, most: float) -> None:
    """Hold the sending thread at its first call of ``requests.Response.<method>`` for ``relay``'s answer
    until the relay sees its connection cut (the attempt's deadline) or ``most`` seconds passed: a
    sender that loses the processor there (a loaded machine) as the deadline comes, made certain."""
    original = getattr(requests.Response, method)
    held: list[str] = []

    def paused(self: requests.Response, *args: Any, **kwargs: Any) -> Any:
        if self.url.startswith(relay.base) and not held:
            held.append(self.url)
            relay.hung_up.wait(most)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(requests.Response, method, paused)


def test_an_answer_read_whole_as_the_deadline_passes_is_delivered(servers, monkeypatch):
    """The relay answers inside the deadline and the sender, having read all of it, is held
    past the deadline before it looks at the outcome: the relay has the event, and so does the row
    (no second copy)."""
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "2")
    relay = servers(FramedRelay, "length", 1.0)  # half the timeout: slack for a loaded machine
    pause_the_sender(monkeypatch, "close", relay, most=3)  # past the deadline
    _, event_id = progress_event(relay.url)
    answer = attempts.attempt(event_id)
    found = delivery(event_id)
    assert (found.state, found.attempts, found.response_code, found.last_error) == ("delivered", 1, 200, None)
    assert (answer.delivered, relay.requests) == (True, 1)


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_an_answer_that_came_whole_before_the_deadline_cut_is_delivered(servers, monkeypatch, framing):
    """The whole answer is in before the deadline but the sender reads it only after the watchdog cut
    the connection: its framing (a length, a last chunk) shows it complete, so it is a delivery."""
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "1")
    relay = servers(FramedRelay, framing)
    pause_the_sender(monkeypatch, "iter_content", relay, most=3)
    _, event_id = progress_event(relay.url)
    answer = attempts.attempt(event_id)
    assert relay.hung_up.is_set()  # the deadline did cut the connection before the answer was read
    found = delivery(event_id)
    assert (found.state, found.attempts, found.response_code, found.last_error) == ("delivered", 1, 200, None)
    assert (answer.delivered, relay.requests) == (True, 1)


def test_an_answer_whose_end_is_the_cut_is_a_timeout(servers, monkeypatch):
    """The control for the test above: an answer that ends only when its connection does is never
    complete when the watchdog's cut is what ended it, however much of it came."""
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "1")
    relay = servers(FramedRelay, "close")
    _, event_id = progress_event(relay.url)
    assert not attempts.attempt(event_id).delivered
    assert relay.hung_up.wait(5)
    found = delivery(event_id)
    assert (found.state, found.attempts, found.last_error) == ("pending", 1, "Timeout: no complete answer within 1 s")


# -- the URL checked again at delivery ---------------------------------------------------

def refused(event_id: str) -> CallbackDelivery:
    found = delivery(event_id)
    assert (found.state, found.attempts, found.response_code, found.delivered_at) == ("failed", 1, None, None)
    assert found.last_error.startswith("refused: ")
    return found


def test_a_host_removed_from_the_allowlist_is_not_posted_to(servers, monkeypatch):
    server = servers(CountingServer)
    tool_call_id, event_id = progress_event(server.url)  # recorded while 127.0.0.1 was allowed
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "relay.example.com")
    answer = attempts.attempt(event_id)
    assert (answer.attempted, answer.delivered) == (True, False)
    assert server.requests == 0
    assert refused(event_id).last_error == (
        "refused: the callback URL host 127.0.0.1 is a private address and is not in VOICE_TOOLS_CALLBACK_HOSTS")
    assert attempts.attempt(event_id).attempted is False and server.requests == 0  # no retries of a refusal
    assert row(tool_call_id).status == "EXECUTING"


def test_the_same_event_with_the_host_still_allowed_is_posted(servers):
    """The control for the test above."""
    server = servers(CountingServer)
    _, event_id = progress_event(server.url)
    assert attempts.attempt(event_id).delivered and server.requests == 1


def test_an_empty_secret_sends_nothing(servers, monkeypatch):
    server = servers(CountingServer)
    _, event_id = progress_event(server.url)
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRET", "")
    assert not attempts.attempt(event_id).delivered
    assert server.requests == 0
    assert refused(event_id).last_error == (
        "refused: VOICE_TOOLS_CALLBACK_SECRET is empty; an unsigned callback is not sent")


def test_a_malformed_standard_webhooks_secret_sends_nothing(servers, monkeypatch):
    server = servers(CountingServer)
    _, event_id = progress_event(server.url)
    good = os.environ["VOICE_TOOLS_CALLBACK_SECRETS"]
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRETS", f"{good},plain-old-secret")
    assert not attempts.attempt(event_id).delivered
    assert server.requests == 0
    assert refused(event_id).last_error == (
        "refused: secret 2 of VOICE_TOOLS_CALLBACK_SECRETS does not start with whsec_")


def test_the_systems_own_port_is_refused_at_delivery(servers, monkeypatch):
    server = servers(CountingServer)
    _, event_id = progress_event(server.url)
    monkeypatch.setenv("FLOWER_PORT", str(server.port))  # the port is now this system's Flower
    assert not attempts.attempt(event_id).delivered
    assert server.requests == 0
    assert refused(event_id).last_error == (
        f"refused: the callback URL port {server.port} on 127.0.0.1 is this system's own Flower port")


def _loopback_name() -> str:
    name = socket.gethostname().lower()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
    except OSError:
        addresses = set()
    if not addresses or not all(a.startswith("127.") for a in addresses) or name == "localhost":
        pytest.skip(f"this machine's name {name!r} does not resolve to loopback only ({addresses})")
    return name


def test_a_name_resolving_inside_is_refused_unless_its_address_is_listed(servers, monkeypatch):
    name = _loopback_name()  # e.g. "vm" -> 127.0.0.1 (/etc/hosts), like a name an attacker points at 10.x
    server = servers(CountingServer)
    url = f"http://{name}:{server.port}/cb"
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", name)
    assert url_policy.url_error(url) is None  # stored: the name is listed
    _, event_id = progress_event(url)
    assert not attempts.attempt(event_id).delivered
    assert server.requests == 0
    last_error = refused(event_id).last_error
    assert last_error.startswith(f"refused: {name} resolves to 127.")
    assert last_error.endswith("a private address that is not itself in VOICE_TOOLS_CALLBACK_HOSTS")

    # Listing the address admits it (and the attempt connects to the address checked).
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", f"{name},127.0.0.1")
    _, listed = progress_event(url)
    assert attempts.attempt(listed).delivered and server.requests == 1
    assert delivery(listed).state == "delivered"


def test_localhost_listed_admits_loopback_but_not_the_own_ports(servers, monkeypatch):
    server = servers(CountingServer)
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "localhost")
    _, event_id = progress_event(f"http://localhost:{server.port}/cb")
    assert attempts.attempt(event_id).delivered and server.requests == 1
    monkeypatch.setenv("PORT", str(server.port))
    _, own = progress_event(f"http://localhost:{server.port}/cb")
    assert not attempts.attempt(own).delivered and server.requests == 1
    assert refused(own).last_error == (
        f"refused: the callback URL port {server.port} on localhost is this system's own API port")


@pytest.mark.parametrize("url, allowed, error", [
    ("http://127.0.0.1:8000/cb", ["127.0.0.1"], "port 8000 on 127.0.0.1 is this system's own API port"),
    ("http://127.0.0.1:8000/cb", ["127.0.0.1:8000"], "own API port"),  # even when named
    ("http://localhost:5555/cb", ["localhost"], "own Flower port"),
    ("http://app.localhost:8001/cb", ["app.localhost"], "own MCP port"),
    ("http://[::1]:8001/cb", ["::1"], "own MCP port"),
    ("http://[::ffff:127.0.0.1]:8000/cb", ["::ffff:127.0.0.1"], "own API port"),
    ("http://0.0.0.0:8000/cb", ["0.0.0.0"], "own API port"),
    ("http://127.0.0.1:9000/cb", ["127.0.0.1"], None),  # a bare host admits any other port (docs/operations.md, Configuration)
    ("https://relay.example.com:8000/cb", ["relay.example.com"], None),  # not a local address
])
def test_the_own_ports_are_never_a_callback_on_a_local_address(monkeypatch, url, allowed, error):
    for name in ("PORT", "MCP_PORT", "FLOWER_PORT"):
        monkeypatch.delenv(name, raising=False)  # voice-tools run's defaults: 8000, 8001, 5555
    found = url_policy.url_error(url, allowed)
    if error is None:
        assert found is None
    else:
        assert found is not None and error in found


def test_the_own_ports_follow_the_environment(monkeypatch):
    monkeypatch.setenv("PORT", "9100")
    assert "own API port" in url_policy.url_error("http://127.0.0.1:9100/cb", ["127.0.0.1"])
    assert url_policy.url_error("http://127.0.0.1:8000/cb", ["127.0.0.1"]) is None


def test_the_run_command_always_has_a_secret(tmp_path, monkeypatch):
    from voice_tools import launcher

    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRET", "")  # set but empty: not a secret
    env, filled = launcher.run_environment(tmp_path)
    assert "VOICE_TOOLS_CALLBACK_SECRET" in filled and len(env["VOICE_TOOLS_CALLBACK_SECRET"]) >= 32
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRET", "   ")
    again, filled = launcher.run_environment(tmp_path)
    assert "VOICE_TOOLS_CALLBACK_SECRET" in filled
    assert again["VOICE_TOOLS_CALLBACK_SECRET"] == env["VOICE_TOOLS_CALLBACK_SECRET"]


FORKED = """
import os
from tasks.delivery import transport
parent = transport.http()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, b"fresh" if transport.http() is not parent else b"shared")
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 16).decode(), "parent-kept" if transport.http() is parent else "parent-lost")
"""


def test_a_forked_child_makes_its_own_http_session():
    """A pool child (or a gunicorn worker) never posts over its parent's pooled connections,
    whoever forks it: the session is made again after every fork."""
    done = subprocess.run([sys.executable, "-c", FORKED], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fresh", "parent-kept"]
