"""Errors are JSON under gunicorn too: the answers gunicorn gives itself, before the app
(a request line or a header over its limits, a request it cannot parse), a chunked body gunicorn
cannot parse (a 400, never a 500, at once: chunk lines ended by a bare LF too), and OPTIONS. A head
over gunicorn's limits is refused as it comes, however much of it is still to come, and costs the
worker no more memory than gunicorn's limits."""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from app.limits import MAX_HEADER_BYTES, MAX_HEADER_FIELDS, MAX_REQUEST_LINE
from tests.api_fixtures import call_count
from tests.conftest import AUTH
from tests.web_server import gunicorn_web


@pytest.fixture(scope="module")
def web():
    with gunicorn_web() as url:
        yield url


def json_error(answer: requests.Response, status: int, error: str) -> dict:
    assert answer.status_code == status, answer.text
    assert answer.headers["Content-Type"].startswith("application/json"), answer.text
    body = answer.json()
    assert set(body) == {"error", "message", "details"}, body
    assert body["error"] == error and body["message"], body
    return body


def test_a_query_string_over_the_request_line_limit_is_a_json_414(web):
    answer = requests.get(f"{web}/voice-tools/tools?format=" + "x" * MAX_REQUEST_LINE, headers=AUTH, timeout=10)
    body = json_error(answer, 414, "uri_too_long")
    assert body["details"]["max_bytes"] == MAX_REQUEST_LINE
    # just under the limit: the app answers (its own JSON 422 for the unknown format)
    line = len("GET /voice-tools/tools?format= HTTP/1.1")
    fits = requests.get(f"{web}/voice-tools/tools?format=" + "x" * (MAX_REQUEST_LINE - line), headers=AUTH,
                        timeout=10)
    json_error(fits, 422, "validation_error")


def test_a_huge_header_is_a_json_431(web):
    answer = requests.get(f"{web}/voice-tools/tools", headers={**AUTH, "X-Big": "x" * (MAX_HEADER_BYTES + 1)},
                          timeout=10)
    body = json_error(answer, 431, "headers_too_large")
    assert body["details"] == {"max_header_bytes": MAX_HEADER_BYTES, "max_headers": MAX_HEADER_FIELDS,
                               "reason": body["details"]["reason"]}


def test_too_many_headers_is_a_json_431(web):
    many = {f"X-H{i}": "1" for i in range(MAX_HEADER_FIELDS + 1)}
    json_error(requests.get(f"{web}/voice-tools/tools", headers={**AUTH, **many}, timeout=10),
               431, "headers_too_large")


def test_a_request_gunicorn_cannot_parse_is_a_json_400(web):
    parts = urlsplit(web)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz?a=1 & HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), raw
    assert b"content-type: application/json" in head.lower(), raw
    assert json.loads(body)["error"] == "bad_request"


def test_options_is_a_json_405_naming_the_methods(web):
    answer = requests.options(f"{web}/voice-tools/tools", headers=AUTH, timeout=10)
    body = json_error(answer, 405, "method_not_allowed")
    assert body["details"]["allowed"] == ["GET", "HEAD"]
    assert answer.headers["Allow"] == "GET, HEAD"
    json_error(requests.options(f"{web}/voice-tools/tools", timeout=10), 401, "unauthorized")


def _exchange(web: str, data: bytes) -> bytes:
    """``data`` sent on a new connection; everything that comes back until the API closes it."""
    parts = urlsplit(web)
    raw = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                raw += chunk
        except ConnectionResetError:
            pass
    return raw


def _chunked(path: bytes = b"/voice-tools/pending", method: bytes = b"POST") -> bytes:
    return (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + AUTH["Authorization"].encode() +
            b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")


MALFORMED_CHUNKS = {
    "a chunk size that is not hex": _chunked() + b"zz\r\n{}\r\n0\r\n\r\n",
    "chunk data without its CRLF": _chunked() + b"2\r\n{}XX0\r\n\r\n",
    "a chunk extension with a control byte": _chunked() + b"2;a=\x01\r\n{}\r\n0\r\n\r\n",
    "on a modify": _chunked(b"/voice-tools/modify/tc_000000000000", b"PATCH") + b"zz\r\n",
    "on the webhook path": _chunked(b"/webhook/voice-tools/execute") + b"zz\r\n",
    "chunk lines ended by a bare LF": _chunked() + b"2\n{}\n0\n\n",
}


def test_chunk_lines_ended_by_a_bare_lf_and_nothing_after_are_a_json_400_at_once(web):
    """No CRLF ever comes: gunicorn and h11 would wait for one until the body's time is up."""
    raw = _exchange(web, _chunked() + b"2\n{}\n0\n\n")  # within the socket's 10 s, the body's time is 30
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower(), raw
    assert json.loads(body)["error"] == "bad_request", raw


@pytest.mark.parametrize("case", list(MALFORMED_CHUNKS))
def test_a_malformed_chunked_body_is_a_json_400_and_its_connection_closes(web, case):
    before = call_count()
    # the same connection's next request is never read as part of the body
    raw = _exchange(web, MALFORMED_CHUNKS[case] + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), raw
    assert b"content-type: application/json" in head.lower(), raw
    assert b"connection: close" in head.lower(), raw
    assert json.loads(body)["error"] == "bad_request", raw
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # one answer, then the connection closed
    assert call_count() == before


def _head_refused_while_sent(web: str, opening: bytes, status: int, error: str) -> None:
    """``opening`` then a line that never ends: answered ``status`` (JSON) while the client still sends."""
    parts = urlsplit(web)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(opening + b"a" * 20_000)  # past every limit, and no end
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw) < raw.index(b"\r\n\r\n") + 4 + _length(raw):
            chunk = sock.recv(65536)
            assert chunk, raw
            raw += chunk
        sock.sendall(b"a" * 20_000)  # the client goes on: its bytes are dropped, the connection then closes
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw
    assert b"connection: close" in head.lower() and b"content-type: application/json" in head.lower(), raw
    assert json.loads(body)["error"] == error


def _length(raw: bytes) -> int:
    head = raw.partition(b"\r\n\r\n")[0].lower()
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in head else 0


def test_a_header_line_that_never_ends_is_a_json_431_at_once(web):
    _head_refused_while_sent(web, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Flood: ", 431, "headers_too_large")


def test_a_request_line_that_never_ends_is_a_json_414_at_once(web):
    _head_refused_while_sent(web, b"GET /healthz?", 414, "uri_too_long")


def test_more_headers_than_the_limit_are_a_json_431_before_the_head_ends(web):
    many = b"".join(b"X-%d: a\r\n" % i for i in range(MAX_HEADER_FIELDS + 1))
    _head_refused_while_sent(web, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"X-Last: ", 431,
                             "headers_too_large")


FLOODS = 100
FLOOD_BYTES = 400_000


def _api_worker(web: str) -> psutil.Process:
    bind = f"127.0.0.1:{urlsplit(web).port}"
    [master] = [p for p in psutil.process_iter(["cmdline"])
                if any("gunicorn" in part for part in p.info["cmdline"] or ()) and bind in " ".join(p.info["cmdline"])
                and "gunicorn" not in " ".join(p.parent().cmdline())]
    [worker] = master.children()
    return worker


def test_header_floods_cost_the_worker_no_more_than_the_limits(web):
    """``FLOODS`` connections each send a header line of ``FLOOD_BYTES`` that never ends: each is answered
    431 and the worker holds no more than gunicorn's line limit of any (read ahead whole, they would cost it
    ``FLOODS * FLOOD_BYTES``, twice)."""
    worker = _api_worker(web)
    before = worker.memory_info().rss
    parts = urlsplit(web)
    line = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Flood: " + b"a" * FLOOD_BYTES
    held, peak = [], before
    try:
        for _ in range(FLOODS):
            sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
            try:
                sock.sendall(line)
            except OSError:
                pass
            held.append(sock)
        time.sleep(0.5)
        peak = worker.memory_info().rss
        answered = 0
        for sock in held:
            try:
                answered += sock.recv(20).startswith(b"HTTP/1.1 431 ")
            except OSError:
                pass
    finally:
        for sock in held:
            sock.close()
    grown = (peak - before) / 1024 / 1024
    print(f"API worker RSS +{grown:.1f} MB beside {FLOODS} header floods of {FLOOD_BYTES} bytes")
    assert answered == FLOODS
    assert grown < FLOODS * FLOOD_BYTES / 1024 / 1024 / 4, grown
