"""Slow or idle clients never silence the API: with 200 unauthenticated connections open that send nothing,
half a header block, half a body or an endless chunk, an authenticated relay is answered at its usual pace,
on each layout the docs give for serving relays (the Procfile's web line; ``voice-tools run``'s,
``Procfile.local``, with ``HOST`` set). A connection the API closes is opened again at once, as a
determined client would. Nor do clients that stop reading: connections that pipeline hundreds of
requests for the console's script (served without a token) and read none of the answers, more of them
than the API has threads, leave the relay and ``/healthz`` answered; each is closed once it has left
its answers untaken for the send timeout."""
from __future__ import annotations

import socket
import struct
import threading
import time
from urllib.parse import urlsplit

import pytest
import requests

from app.limits import HEAD_SECONDS
from support.procs import free_port
from tests.conftest import AUTH
from tests.web_server import gunicorn_web

pytestmark = [pytest.mark.fault, pytest.mark.slow]

OPENINGS = {
    "idle": b"",
    "half-header": b"GET /voice-tools/tools HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    "half-body": b"POST /voice-tools/pending HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{",
    "endless-chunk": b"POST /voice-tools/pending HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n{",
}
CONNECTIONS = 200
ROUNDS = 100


class SlowClients:
    """``CONNECTIONS`` connections, as many of each kind, each opened again when the server closes it."""

    def __init__(self, url: str, path: str = "/voice-tools/pending") -> None:
        parts = urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.openings = {kind: opening.replace(b" /voice-tools/pending ", f" {path} ".encode())
                         for kind, opening in OPENINGS.items()}
        self.held: list[tuple[str, socket.socket]] = []
        self.reopened = 0
        self.stopping = threading.Event()
        self.keeper = threading.Thread(target=self._keep, daemon=True)

    def _open(self, kind: str) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=10)
        if self.openings[kind]:
            sock.sendall(self.openings[kind])
        sock.setblocking(False)
        return sock

    def __enter__(self) -> "SlowClients":
        kinds = list(OPENINGS)
        self.held = [(kinds[i % len(kinds)], self._open(kinds[i % len(kinds)])) for i in range(CONNECTIONS)]
        self.keeper.start()
        return self

    def _keep(self) -> None:
        while not self.stopping.wait(0.2):
            for index, (kind, sock) in enumerate(self.held):
                try:
                    closed = sock.recv(65536) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed and not self.stopping.is_set():
                    sock.close()
                    self.held[index] = (kind, self._open(kind))
                    self.reopened += 1

    def still_open(self) -> int:
        return sum(1 for _, sock in self.held if sock.fileno() != -1)

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.keeper.join(10)
        for _, sock in self.held:
            sock.close()


def relay_timings(url: str, seconds: float = 0, mcp: bool = False) -> list[float]:
    """An authenticated relay's requests (``GET /voice-tools/tools``, or MCP's ``tools/list``), ``ROUNDS`` of
    them and for ``seconds`` at least: half on a kept-alive session, half each on a new connection."""
    timings: list[float] = []
    end = time.monotonic() + seconds
    with requests.Session() as session:
        while len(timings) < ROUNDS or time.monotonic() < end:
            client = session if len(timings) % 2 else requests
            started = time.monotonic()
            if mcp:
                answer = client.post(f"{url}/mcp", json=MCP_LIST, timeout=15,
                                     headers={**AUTH, "Accept": "application/json, text/event-stream"})
            else:
                answer = client.get(f"{url}/voice-tools/tools", headers=AUTH, timeout=15)
            timings.append(time.monotonic() - started)
            assert answer.status_code == 200, answer.text
    return timings


MCP_LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}


def p99(timings: list[float]) -> float:
    return sorted(timings)[int(len(timings) * 0.99) - 1]


LAYOUTS = {
    "Procfile": {"WEB_CONCURRENCY": "2"},  # production's default of two workers
    "Procfile.local": {"WEB_CONCURRENCY": "1"},  # voice-tools run, HOST set (here the loopback: one machine)
}


@pytest.mark.parametrize("procfile", list(LAYOUTS))
def test_200_slow_unauthenticated_connections_do_not_silence_the_api(procfile):
    with gunicorn_web(procfile, MCP_PORT=str(free_port()), **LAYOUTS[procfile]) as url:
        alone = relay_timings(url)
        with SlowClients(url) as slow:
            time.sleep(1)  # every kind has sent what it sends
            crowded = relay_timings(url, seconds=HEAD_SECONDS + 3)  # past the time the API gives a head
            assert slow.still_open() == CONNECTIONS
        assert slow.reopened >= CONNECTIONS // 2  # the idle and half-header ones were closed by the API, and came back
        print(f"{procfile}: relay p99 {p99(alone) * 1000:.1f} ms alone, {p99(crowded) * 1000:.1f} ms beside "
              f"{CONNECTIONS} slow connections ({slow.reopened} opened again after the API closed them)")
        assert p99(crowded) <= 1.0, sorted(crowded)[-5:]
        # and afterwards, as before
        assert p99(relay_timings(url)) <= 1.0


NON_READERS = 24  # more than the Procfile's 2 workers x 8 threads
PIPELINED = 400
SEND_TIMEOUT = 3  # VOICE_TOOLS_SEND_TIMEOUT of the web line under test (30 by default)
TCP_ESTABLISHED = 1  # tcp_info's tcpi_state (include/net/tcp_states.h)


class NonReaders:
    """``NON_READERS`` connections, each sending ``PIPELINED`` requests at once and reading no answer."""

    def __init__(self, url: str, path: str = "/console/static/console.js") -> None:
        parts = urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.requests = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * PIPELINED
        self.held: list[socket.socket] = []

    def __enter__(self) -> "NonReaders":
        for _ in range(NON_READERS):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: it is full sooner
            sock.settimeout(10)
            sock.connect(self.address)
            sock.sendall(self.requests)
            self.held.append(sock)
        return self

    def established(self) -> int:
        """How many are still open on the API's side (a reset or a close ends the TCP state here too)."""
        return sum(1 for sock in self.held
                   if struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]
                   == TCP_ESTABLISHED)

    def __exit__(self, *exc: object) -> None:
        for sock in self.held:
            sock.close()


def healthz_answered(url: str, times: int = 5) -> int:
    answered = 0
    for _ in range(times):
        try:
            answered += requests.get(f"{url}/healthz", timeout=5).status_code == 200
        except requests.RequestException:
            pass
    return answered


@pytest.mark.parametrize("procfile", list(LAYOUTS))
def test_clients_that_stop_reading_hold_no_thread_and_are_closed_after_the_send_timeout(procfile):
    with gunicorn_web(procfile, MCP_PORT=str(free_port()), VOICE_TOOLS_SEND_TIMEOUT=str(SEND_TIMEOUT),
                      **LAYOUTS[procfile]) as url:
        with NonReaders(url) as stuck:
            time.sleep(1)
            assert stuck.established() == NON_READERS
            # for long enough that each is answered until its window and the API's send buffer are full
            crowded = relay_timings(url, seconds=10)
            assert healthz_answered(url) == 5
            print(f"{procfile}: relay p99 {p99(crowded) * 1000:.1f} ms beside {NON_READERS} clients that stopped "
                  f"reading")
            assert p99(crowded) <= 1.0, sorted(crowded)[-5:]
            deadline = time.monotonic() + SEND_TIMEOUT + 10
            while stuck.established() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert stuck.established() == 0  # each closed, its answers given up
        assert p99(relay_timings(url)) <= 1.0


def test_200_slow_unauthenticated_connections_do_not_silence_the_mcp_face():
    """``voice-tools run``'s MCP face (served by the API's worker, uvicorn on its own loop) beside the same crowd."""
    mcp_port = free_port()
    with gunicorn_web("Procfile.local", MCP_PORT=str(mcp_port)):
        url = f"http://127.0.0.1:{mcp_port}"
        alone = relay_timings(url, mcp=True)  # the first loads the face
        with SlowClients(url, path="/mcp") as slow:
            time.sleep(1)
            crowded = relay_timings(url, mcp=True)
            assert slow.still_open() == CONNECTIONS
        print(f"MCP face: p99 {p99(alone[1:]) * 1000:.1f} ms alone, {p99(crowded) * 1000:.1f} ms beside "
              f"{CONNECTIONS} slow connections")
        assert p99(crowded) <= 1.0, sorted(crowded)[-5:]
