"""An answer given before the request's body was read (413 too large, 401 before the body, 431) says
``Connection: close`` and closes, so a kept-alive client's next request never lands in the unread body:
a real client on one connection against the Procfile's web line (real gunicorn)."""
from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit

import pytest
import requests

from app.limits import MAX_BODY_BYTES, MAX_HEADER_BYTES
from tests.conftest import AUTH
from tests.web_server import gunicorn_web

BIG = json.dumps({"tool_name": "send_email", "parameters": {"body": "x" * 300_000}}).encode()
assert len(BIG) > MAX_BODY_BYTES


@pytest.fixture(scope="module")
def web():
    with gunicorn_web() as url:
        yield url


def _connection(web: str) -> http.client.HTTPConnection:
    parts = urlsplit(web)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=20)


def _send_big(conn: http.client.HTTPConnection, headers: dict[str, str], chunked: bool = False) -> None:
    """The whole body is sent, as a client that does not wait for an early answer does."""
    if chunked:
        def chunks():
            for start in range(0, len(BIG), 16 * 1024):
                yield BIG[start:start + 16 * 1024]
        conn.request("POST", "/voice-tools/pending", body=chunks(), encode_chunked=True,
                     headers={**headers, "Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    else:
        conn.request("POST", "/voice-tools/pending", body=BIG, headers={**headers, "Content-Type": "application/json"})


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("token", [True, False], ids=["413", "401"])
def test_an_answer_before_the_body_closes_and_says_so(web, token, chunked):
    conn = _connection(web)
    try:
        _send_big(conn, AUTH if token else {}, chunked=chunked)
        answer = conn.getresponse()
        body = json.loads(answer.read())
        assert answer.status == (413 if token else 401), body
        assert body["error"] == ("too_large" if token else "unauthorized"), body
        assert answer.getheader("Connection") == "close", answer.getheaders()
        # the client's next request succeeds (http.client opens a new connection after a close)
        conn.request("GET", "/voice-tools/tools", headers=AUTH)
        answer = conn.getresponse()
        assert answer.status == 200, answer.read()
        answer.read()
    finally:
        conn.close()


def test_a_kept_alive_session_goes_on_after_a_413(web):
    """requests' session, which keeps its connection alive: the request after a 300 KB body succeeds, every round."""
    with requests.Session() as session:
        for _ in range(10):
            answer = session.post(f"{web}/voice-tools/pending", headers={**AUTH, "Content-Type": "application/json"},
                                  data=BIG, timeout=20)
            assert answer.status_code == 413, answer.text
            assert answer.headers["Connection"] == "close"
            assert session.get(f"{web}/voice-tools/tools", headers=AUTH, timeout=20).status_code == 200


def test_a_431_closes_and_says_so(web):
    parts = urlsplit(web)
    with socket.create_connection((parts.hostname, parts.port), timeout=20) as sock:
        sock.sendall(b"POST /voice-tools/pending HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Big: " + b"x" * (MAX_HEADER_BYTES + 1) + b"\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(BIG) + BIG)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), raw[:300]
    assert b"\r\nConnection: close\r\n" in head, head
    assert json.loads(body)["error"] == "headers_too_large"
