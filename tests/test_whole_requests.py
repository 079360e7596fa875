"""The Procfile's web line reads each request whole before a thread serves it (``app/gunicorn_worker.py``):
what a client sends in pieces, two requests sent at once, a request only gunicorn's parser accepts are
served as before; a client that stops half-way is closed, holding no thread."""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.conftest import API_TOKEN
from tests.web_server import gunicorn_web, read_answers, served_after_idle


@pytest.fixture(scope="module")
def web():
    with gunicorn_web(GUNICORN_THREADS="2") as url:
        yield url


def _connect(web: str) -> socket.socket:
    parts = urlsplit(web)
    return socket.create_connection((parts.hostname, parts.port), timeout=20)


GET = f"GET /voice-tools/tools HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_TOKEN}\r\n\r\n".encode()


def test_a_request_sent_in_pieces_is_served(web):
    body = json.dumps({"tool_name": "nope", "parameters": {}}).encode()
    request = (f"POST /voice-tools/pending HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_TOKEN}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with _connect(web) as sock:
        for start in range(0, len(request), 40):
            sock.sendall(request[start:start + 40])
            time.sleep(0.02)
        [(status, answer)] = read_answers(sock, 1)
    assert status == 422 and json.loads(answer)["error"] == "validation_error", answer


def test_two_requests_sent_at_once_are_both_answered(web):
    with _connect(web) as sock:
        sock.sendall(GET + GET)
        assert [status for status, _ in read_answers(sock, 2)] == [200, 200]
        sock.sendall(GET)  # and the connection goes on
        assert [status for status, _ in read_answers(sock, 1)] == [200]


def test_a_kept_alive_connection_idle_for_a_spoken_turn_serves_the_next_request(web):
    """A relay's requests about one call come seconds apart (the caller speaks in between). The server keeps
    the connection that long: one it closed as the relay sent its next request would lose that request
    (``RemoteDisconnected``; a client library does not send a POST again)."""
    with _connect(web) as sock:
        assert served_after_idle(sock, GET) == [200, 200]


def test_an_http_1_1_request_without_host_is_answered_as_gunicorn_answers_it(web):
    """h11 refuses it; gunicorn's parser, which has the last word, serves it from what came."""
    with _connect(web) as sock:
        sock.sendall(GET.replace(b"Host: x\r\n", b""))
        [(status, _)] = read_answers(sock, 1)
    assert status == 200


def test_clients_stopping_half_way_hold_no_thread(web):
    """Two threads, three clients of each kind stopped half-way (a head, a body, an endless chunk, nothing):
    a whole request is still answered."""
    openings = [b"GET /voice-tools/tools HTTP/1.1\r\nHost: x\r\nX-Slow: ",
                b"POST /voice-tools/pending HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{",
                b"POST /voice-tools/pending HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"ffffffffffffffff\r\n{",
                b""] * 3
    held = [_connect(web) for _ in openings]
    try:
        for sock, opening in zip(held, openings):
            if opening:
                sock.sendall(opening)
        time.sleep(0.5)
        with _connect(web) as sock:
            sock.sendall(GET)
            assert [status for status, _ in read_answers(sock, 1)] == [200]
    finally:
        for sock in held:
            sock.close()
