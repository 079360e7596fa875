"""The MCP port's framing follows REST's rules, on both its hosts (``voice-tools mcp``, and the API's worker
under ``Procfile.local``'s web line): a request with both Content-Length and Transfer-Encoding is a JSON 400
and its connection closes (the request behind it is never answered), a head over gunicorn's limits is a
JSON 414 or 431 as it comes, a chunk line ended by a bare LF a JSON 400 at once, whatever h11 refuses is
JSON too, and a client that sends half a head is cut after ``HEAD_SECONDS``."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import requests

from app.limits import HEAD_SECONDS, MAX_HEADER_FIELDS
from support.procs import ROOT, free_port, stop_process
from tests.conftest import AUTH
from tests.web_server import gunicorn_web, served_after_idle

pytestmark = [pytest.mark.fault, pytest.mark.slow]

BEARER = AUTH["Authorization"].encode()
NEXT = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@contextmanager
def standalone() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voice_tools", "mcp", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        _answering(port, proc)
        yield port
    finally:
        stop_process(proc)


@contextmanager
def in_worker() -> Iterator[int]:
    port = free_port()
    with gunicorn_web("Procfile.local", MCP_PORT=str(port)):
        _answering(port)
        yield port


def _answering(port: int, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert proc is None or proc.poll() is None
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=60).status_code == 200:
                return
        except requests.RequestException:
            assert time.monotonic() < deadline
            time.sleep(0.2)


FACES = {"voice-tools mcp": standalone, "the API's worker": in_worker}


@pytest.fixture(scope="module", params=list(FACES))
def mcp_port(request):
    with FACES[request.param]() as port:
        yield port


def _exchange(port: int, data: bytes, more: bytes = b"") -> bytes:
    """``data`` on a new connection (then ``more``, once an answer came); all that comes until it closes."""
    raw = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                raw += chunk
                if more:
                    sock.sendall(more)
                    more = b""
        except (ConnectionResetError, BrokenPipeError):
            pass
    return raw


def _refused(raw: bytes, status: int, error: str) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw
    assert b"connection: close" in head.lower() and b"content-type: application/json" in head.lower(), raw
    answer = json.loads(body)
    assert set(answer) == {"error", "message", "details"} and answer["error"] == error, raw
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # the request behind it is never answered


def _post(*headers: bytes) -> bytes:
    return b"POST /mcp HTTP/1.1\r\nHost: x\r\n" + BEARER.join([b"Authorization: ", b"\r\n"]) + \
        b"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n" + \
        b"".join(header + b"\r\n" for header in headers) + b"\r\n"


def test_content_length_with_transfer_encoding_is_a_json_400_that_closes(mcp_port):
    for first, second in ((b"Content-Length: 4", b"Transfer-Encoding: chunked"),
                          (b"Transfer-Encoding: chunked", b"Content-Length: 60")):
        _refused(_exchange(mcp_port, _post(first, second) + b"0\r\n\r\n" + NEXT), 400, "bad_request")


def test_what_h11_refuses_is_json(mcp_port):
    _refused(_exchange(mcp_port, _post(b"Content-Length: 2", b"Content-Length: 0") + b"{}" + NEXT),
             400, "bad_request")
    _refused(_exchange(mcp_port, _post(b"Transfer-Encoding: gzip, chunked") + b"2\r\n{}\r\n0\r\n\r\n" + NEXT),
             400, "bad_request")  # h11 reads no other transfer coding: a 400, no 5xx for what a client sent


def test_a_head_over_gunicorns_limits_is_refused_as_it_comes(mcp_port):
    flood = b"a" * 20_000  # no end: the answer comes while the client would still send
    _refused(_exchange(mcp_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Flood: " + flood, more=flood),
             431, "headers_too_large")
    _refused(_exchange(mcp_port, b"GET /healthz?" + flood, more=flood), 414, "uri_too_long")
    many = b"".join(b"X-%d: a\r\n" % i for i in range(MAX_HEADER_FIELDS + 1))
    _refused(_exchange(mcp_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"), 431, "headers_too_large")
    _refused(_exchange(mcp_port, b"GET /healthz HTTP/1.1\nHost: x\n\n"), 400, "bad_request")
    # within the limits, as REST: a whole 8 KB header is served
    fits = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\nConnection: close\r\n\r\n"
    assert _exchange(mcp_port, fits).startswith(b"HTTP/1.1 200 ")


def test_a_chunk_line_ended_by_a_bare_lf_is_a_json_400_at_once(mcp_port):
    _refused(_exchange(mcp_port, _post(b"Transfer-Encoding: chunked") + b"2\n{}\n0\n\n"), 400, "bad_request")


def test_half_a_head_is_cut_after_the_head_time(mcp_port):
    with socket.create_connection(("127.0.0.1", mcp_port), timeout=HEAD_SECONDS + 20) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started = time.monotonic()
        try:
            assert sock.recv(65536) == b""  # closed without an answer
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < HEAD_SECONDS + 15


def test_a_kept_alive_connection_idle_for_a_spoken_turn_serves_the_next_request(mcp_port):
    """As on the REST port (tests/test_whole_requests.py): uvicorn's own keep-alive (5 s) would close a
    relay's connection between two requests of a call, and lose the one sent just as it closes."""
    with socket.create_connection(("127.0.0.1", mcp_port), timeout=20) as sock:
        assert served_after_idle(sock, NEXT) == [200, 200]


def test_every_refusal_of_the_app_is_json_too(mcp_port):
    """Starlette's own 404 and 405 and the SDK's plain-text refusals carry REST's JSON body."""
    base = f"http://127.0.0.1:{mcp_port}"
    for answer, status, error in (
            (requests.get(f"{base}/nope", headers=AUTH, timeout=10), 404, "not_found"),
            (requests.put(f"{base}/healthz", timeout=10), 405, "method_not_allowed"),
            (requests.post(f"{base}/mcp", headers={**AUTH, "Accept": "application/json, text/event-stream"},
                           data=b"0", timeout=10), 400, "bad_request")):
        assert answer.status_code == status, answer.text
        assert answer.headers["Content-Type"].startswith("application/json"), answer.text
        assert set(answer.json()) == {"error", "message", "details"} and answer.json()["error"] == error
