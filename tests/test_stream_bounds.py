"""A stream never outlives its client (docs/operations.md, "Event streams, waits and threads"): a client
that leaves the stream's data untaken for ``VOICE_TOOLS_SEND_TIMEOUT`` seconds is closed, its slot of its
caller's open share given back and its listener subscription removed; it resumes with ``Last-Event-ID``
and loses nothing.
"""
from __future__ import annotations

import os
import re
import socket
import time
import uuid

import requests

from support.sse_client import Stream
from tests.helpers import make_call

FRAME = re.compile(rb"id: ([0-9a-f]{32})\nevent: \w+\ndata: [^\n]*\n\n")


def a_caller_with_one_slot(monkeypatch) -> tuple[str, str]:
    """A caller of its own whose open share is one long-held request: its name and token."""
    name, token = f"stall-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"{os.environ['VOICE_TOOLS_API_TOKENS']},{name}:{token}")
    monkeypatch.setenv("VOICE_TOOLS_CALLER_LIMITS", f"{name}::1")
    return name, token


def a_backlog(session_id: str, caller: str, events: int = 400, size: int = 8000) -> list[str]:
    """``events`` events of about ``size`` bytes each in ``session_id``, of ``caller``'s call; their ids in order."""
    from sqlalchemy import text

    from models import db, events as event_rows, lifecycle

    call = make_call(session_id=session_id, caller=caller)
    with db.session() as s:
        for k in range(events):
            lifecycle.record_event(s, call.tool_call_id, event_rows.event(
                "progress", step="PREPARING", gate=1, progress=0.1, message=f"{k:05d}" + "x" * size))
    with db.engine().connect() as conn:
        return list(conn.execute(text("SELECT event_id FROM callback_deliveries WHERE session_id = :s "
                                      "ORDER BY commit_seq"), {"s": session_id}).scalars())


def a_client_that_stops_reading(port: int, session_id: str, token: str) -> tuple[socket.socket, str]:
    """A client with a small receive buffer that reads the answer's head and first events, then reads no
    more; the last event it took whole."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /voice-tools/events/{session_id} HTTP/1.1\r\nHost: x\r\n"
                 f"Authorization: Bearer {token}\r\n\r\n".encode())
    sock.settimeout(10)
    got = b""
    while len(FRAME.findall(got)) < 3:
        chunk = sock.recv(4096)
        assert chunk, got[:300]
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    return sock, FRAME.findall(got)[-1].decode()


def closed_by_the_server(sock: socket.socket, within: float) -> bool:
    """Does the server close the connection (after what it had sent) within ``within`` seconds?"""
    deadline = time.monotonic() + within
    sock.settimeout(1)
    while time.monotonic() < deadline:
        try:
            if not sock.recv(1 << 20):
                return True
        except socket.timeout:
            continue
        except ConnectionError:
            return True
    return False


def test_a_client_that_stops_reading_is_closed_after_the_bound_and_resumes_losing_nothing(api_url, monkeypatch):
    from app import stream_loop
    from models import listen

    name, token = a_caller_with_one_slot(monkeypatch)
    monkeypatch.setenv("VOICE_TOOLS_SEND_TIMEOUT", "2")
    session_id = f"stall_{uuid.uuid4().hex[:8]}"
    backlog = a_backlog(session_id, name)  # about 3 MB
    auth = {"Authorization": f"Bearer {token}"}
    served_before = stream_loop.open_streams()
    port = int(api_url.rsplit(":", 1)[1])
    stalled, last = a_client_that_stops_reading(port, session_id, token)
    try:
        refused = requests.get(f"{api_url}/voice-tools/events/{session_id}", headers=auth, timeout=10)
        assert refused.status_code == 429, refused.text  # the stalled stream holds the caller's one slot
        deadline = time.monotonic() + 2 + 10  # the bound, and room for a loaded machine
        while stream_loop.open_streams() > served_before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stream_loop.open_streams() == served_before, "a client that reads nothing is never closed"
        assert ("voice_tools_events", session_id) not in listen.LISTENER._waiters  # unsubscribed
        assert closed_by_the_server(stalled, 10)
    finally:
        stalled.close()
    resumed = Stream(f"{api_url}/voice-tools/events/{session_id}", {**auth, "Last-Event-ID": last})
    try:
        assert resumed.response.status_code == 200, resumed.response.text  # the slot is back
        rest = backlog[backlog.index(last) + 1:]
        assert [resumed.next_event()[0] for _ in rest] == rest  # every event after the last one taken, in order
    finally:
        resumed.close()


def test_the_watch_lets_the_loop_turn_while_it_looks_at_a_thousand_connections(monkeypatch):
    """The watch looks at every connection of the loop about once a second; with a thousand open, it hands
    the loop back between slices of them, so a stream's event waits for a slice at most, never for the
    whole look (``python -m bench.stream``: a look at 1,200 connections held the loop for 5 ms and more)."""
    import asyncio

    from app import stream_loop

    count = 1000
    monkeypatch.setattr(stream_loop, "WATCH_EVERY_S", 0.05)
    seen_partway: list[int] = []

    async def look() -> None:
        pairs = [socket.socketpair() for _ in range(count)]
        connections = []
        try:
            for ours, _ in pairs:
                _, writer = await asyncio.open_connection(sock=ours)
                connection = stream_loop.Connection(writer, asyncio.current_task())
                connection.since = 0.0  # not looked at yet
                connections.append(connection)
            # a set of the test's own: the process's stream loop, if an earlier test started it, watches its own
            # set from its thread, and would look at these too (all of them between two turns of this loop)
            watch = asyncio.get_running_loop().create_task(stream_loop._watch_forever(set(connections)))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a turn of the loop: how many has the watch looked at?
                looked = sum(1 for connection in connections if connection.since > 0.0)
                if looked == count:
                    break
                if looked:
                    seen_partway.append(looked)
                await asyncio.sleep(0)
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            assert looked == count, f"the watch looked at {looked} of {count} connections"
        finally:
            for connection in connections:
                connection.writer.close()
            for _, theirs in pairs:
                theirs.close()

    asyncio.run(look())
    assert seen_partway, "the loop never turned while the watch looked at its connections"


def test_an_answer_that_fails_on_the_stream_loop_is_logged_and_its_connection_closed(caplog):
    """A wait's or a stream's task that raises closes its client's connection (it gets no answer), gives its
    slot back, and says why in the log: never a connection closed with nothing logged."""
    import asyncio
    import logging

    from app import stream_loop

    released = []

    class Slot:
        def release(self) -> None:
            released.append(True)

    async def fails(connection: stream_loop.Connection) -> bool:
        raise RuntimeError("the answer could not be made")

    ours, theirs = socket.socketpair()
    with theirs, caplog.at_level(logging.ERROR, logger="app.stream_loop"):
        asyncio.run(stream_loop._served(ours, Slot(), fails, "wait"))
        theirs.settimeout(5)
        assert theirs.recv(1) == b""  # closed, without an answer
    assert released == [True]
    [record] = [r for r in caplog.records if r.name == "app.stream_loop"]
    assert record.getMessage() == "wait failed" and "the answer could not be made" in caplog.text, caplog.text
