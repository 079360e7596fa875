"""Relay sessions over two API hosts, for the multi-host test: every tool, failover, followed streams.

:class:`HostsTraffic` is ``tests/traffic.py``'s relay with what a relay in front of several API
hosts does: each session picks one API host, and a request that got no answer (its host gone)
is sent again to the other one, the ``pending`` with the same ``Idempotency-Key`` (counted in
``failovers``); one operation, ``mcp``, records its call through the host's MCP face instead
(``request_tool``, with an idempotency key). Its calls are of all nine tools, each with its registry ``example`` parameters
(a meeting each at its own hour); a write tool is confirmed to its checkpoint and resumed. One
more operation, ``race``, sends a resume and a cancel of one PREPARED call at the same moment,
one to each API host: the cancel wins before the point of no return (after the resume too),
and is refused (409 ``too_late``) after it.

:class:`Followers` follows the event stream of each of the sessions (``STREAMS`` session ids,
shared by the sessions in turn) for the whole run, each through one API host; a stream that ends
or breaks is opened again on the other host with ``Last-Event-ID`` (counted in ``resumed``).
:meth:`Followers.problems` then holds every stream to the rows: each event_id once, none
missing, none extra, and each call's events in the order 1, 2, 3 ... of their seq.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import httpx2
import requests
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from support.sse_client import Stream
from tasks import tools
from tests.traffic import EXPECTED, Answer, Traffic

OPERATIONS = ("pending", "modify", "confirm", "resume", "cancel", "relay_cancel", "race", "mcp")
STREAMS = 6  # session ids, each followed by one stream


def session_id(number: int) -> str:
    return f"sess_mh_{number % STREAMS}"


class HostsTraffic(Traffic):
    def __init__(self, bases: list[str], auth: dict[str, str], relay: Any, *, ops: int, seed: int,
                 mcp_urls: list[str] = (), timeout: float = 60.0):
        super().__init__(bases[0], auth, relay, ops=ops, seed=seed, timeout=timeout)
        self.bases = list(bases)
        self.mcp_urls = list(mcp_urls)  # each API host's MCP endpoint, beside its REST base
        self.failovers = 0
        self.waiting: Counter = Counter()  # ?wait requests under way, by API host (its index in bases)
        self.races: list[tuple[str, int | None, int | None]] = []  # (call, resume's status, cancel's status)
        self.tools_used: set[str] = set()
        self.arrivals: dict[str, list[float]] = defaultdict(list)  # event_id -> when each copy reached the relay
        self.confirmed: set[str] = set()  # calls whose confirm was taken (200 or 202)
        self.resumed: set[str] = set()  # calls whose resume was taken
        self._meetings = iter(range(10**6))
        self._write_tools = [name for name in tools.names()
                             if any(step.checkpoint for step in tools.TOOLS[name].steps)]

    def _relay_answer(self, event: dict[str, Any]) -> dict[str, Any] | None:
        with self._lock:
            self.arrivals[event["event_id"]].append(time.monotonic())
        return super()._relay_answer(event)

    def duplicate_problems(self, windows: list[tuple[float, float]], failed_attempts: dict[str, int]) -> list[str]:
        """Events the relay received more than once although their first copy came outside every fault
        window and their row records fewer failed attempts than copies sent again (delivery is at least
        once: a copy again only when the sender did not have the relay's whole answer, an attempt
        recorded failed, or its host lost or cut off as the answer came). ``failed_attempts``: event_id
        -> the failed attempts its row records."""
        with self._lock:
            arrivals = {event_id: list(times) for event_id, times in self.arrivals.items()}
        return [f"event {event_id} received {len(times)} times, its first copy outside every fault, "
                f"{failed_attempts.get(event_id, 0)} failed attempts recorded"
                for event_id, times in arrivals.items()
                if len(times) - 1 > failed_attempts.get(event_id, 0)
                and not any(start <= times[0] <= end for start, end in windows)]

    def resent(self, failed_attempts: dict[str, int]) -> int:
        """How many copies the relay received again after an attempt its row records failed (for the summary)."""
        with self._lock:
            return sum(min(len(times) - 1, failed_attempts.get(event_id, 0))
                       for event_id, times in self.arrivals.items())

    # -- a session on one of the API hosts -------------------------------------------------

    def session(self, number: int, stop: threading.Event | None = None) -> None:
        rng = random.Random(self.rng.random() + number)
        self._local.preferred = rng.randrange(len(self.bases))
        self._local.session_id = session_id(number)
        call: dict[str, Any] = {}
        for _ in range(self.ops):
            if stop is not None and stop.is_set():
                break
            call = getattr(self, f"_{rng.choice(OPERATIONS)}")(number, call, rng)
        with self._lock:
            self.sessions += 1

    def _request(self, operation: str, method: str, path: str, *, base: int | None = None,
                 headers: dict[str, str] | None = None, **kw: Any) -> dict[str, Any] | None:
        """As :meth:`Traffic._request`, on the session's API host, and on the other one when it got no answer."""
        http = getattr(self._local, "http", None)
        if http is None:
            http = self._local.http = requests.Session()
        first = self._local.preferred if base is None else base
        waits = "wait" in kw.get("params", {})
        started = time.monotonic()
        self._local.status = None
        for attempt, host in enumerate((first, 1 - first)):
            url = f"{self.bases[host]}{path}"
            if waits:
                with self._lock:
                    self.waiting[host] += 1
            try:
                while True:
                    response = http.request(method, url, headers={**self.auth, **(headers or {})},
                                            timeout=self.timeout, **kw)
                    if not self._told_to_pause(response) or time.monotonic() - started > self.timeout:
                        break
                    time.sleep(int(response.headers["Retry-After"]))
            except requests.RequestException as exc:
                if attempt == 0:  # its host is gone: the other one
                    with self._lock:
                        self.failovers += 1
                    http = self._local.http = requests.Session()  # no pooled connection to the lost host
                    continue
                self._record(Answer(operation, None, started, time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
                return None
            finally:
                if waits:
                    with self._lock:
                        self.waiting[host] -= 1
            break
        self._local.status = response.status_code
        if operation in ("confirm", "resume"):
            self._took(operation, path)
        self._record(Answer(operation, response.status_code, started, time.monotonic(),
                            "" if response.status_code in EXPECTED else response.text[:300]))
        if response.status_code >= 300:
            return None
        return response.json()

    def _took(self, operation: str, path: str) -> None:
        """Keep the call of a confirm or resume that was taken (the request just answered)."""
        if self._local.status in (200, 202):
            with self._lock:
                (self.confirmed if operation == "confirm" else self.resumed).add(path.rsplit("/", 1)[1])

    # -- calls of every tool ---------------------------------------------------------------------

    def _parameters(self, name: str) -> dict[str, Any]:
        example = dict(tools.TOOLS[name].example)
        if name == "schedule_meeting":  # each meeting at an hour of its own: none finds its slot taken
            with self._lock:
                hour = next(self._meetings)
            example["start"] = (datetime.fromisoformat(example["start"]) + timedelta(hours=hour)).isoformat()
        return example

    def _new(self, number: int, rng: random.Random, name: str | None = None) -> dict[str, Any]:
        name = name or rng.choice(tools.names())
        with self._lock:
            self.tools_used.add(name)
        body = {"session_id": self._local.session_id, "function": name, "callback_url": self.relay.url,
                "parameters": self._parameters(name)}
        return self._request("pending", "POST", "/voice-tools/pending", json=body,
                             headers={"Idempotency-Key": uuid.uuid4().hex}) or {}

    def _modify(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        call = (call if call.get("status") == "PENDING" and call.get("function_name") == "send_email"
                else self._new(number, rng, "send_email"))
        if not call:
            return call
        changed = self._request("modify", "PATCH", f"/voice-tools/modify/{call['tool_call_id']}",
                                json={"parameters": {"subject": f"Changed {rng.randrange(10**6)}"}})
        return {**call, **(changed or {})}

    def _mcp(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """Record a call through the MCP face of the session's API host (the other's if that one is gone)."""
        name = rng.choice(tools.names())
        with self._lock:
            self.tools_used.add(name)
        arguments = {"session_id": self._local.session_id, "function": name, "callback_url": self.relay.url,
                     "parameters": self._parameters(name), "idempotency_key": uuid.uuid4().hex}
        started = time.monotonic()
        first = self._local.preferred
        for attempt, host in enumerate((first, 1 - first)):
            try:
                result = asyncio.run(self._mcp_call(self.mcp_urls[host], "request_tool", arguments))
            except Exception as exc:  # noqa: BLE001 - no answer from this host: the other one
                if attempt == 0:
                    with self._lock:
                        self.failovers += 1
                    continue
                self._record(Answer("mcp_request", None, started, time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
                return {}
            break
        if result.is_error:
            self._record(Answer("mcp_request", None, started, time.monotonic(), result.content[0].text[:300]))
            return {}
        self._record(Answer("mcp_request", 201, started, time.monotonic()))
        return json.loads(result.content[0].text)

    async def _mcp_call(self, url: str, name: str, arguments: dict[str, Any]) -> Any:
        async with httpx2.AsyncClient(headers=self.auth, timeout=self.timeout) as http:
            async with Client(streamable_http_client(url, http_client=http)) as client:
                return await client.call_tool(name, arguments)

    def _race(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """A resume and a cancel of one PREPARED call at once, one to each API host."""
        call = self._confirm(number, self._new(number, rng, rng.choice(self._write_tools)), rng)
        if call.get("status") != "PREPARED":
            return call
        tool_call_id = call["tool_call_id"]
        gate = threading.Barrier(2)
        preferred, session = self._local.preferred, self._local.session_id

        def send(operation: str, method: str, path: str, body: dict[str, Any], base: int) -> int | None:
            self._local.preferred, self._local.session_id = preferred, session
            gate.wait(5)
            self._request(operation, method, path, json=body, base=base)
            return self._local.status

        with ThreadPoolExecutor(2) as pool:
            resumed = pool.submit(send, "resume", "POST", f"/voice-tools/resume/{tool_call_id}",
                                  {"action": "proceed"}, preferred)
            cancelled = pool.submit(send, "cancel", "DELETE", f"/voice-tools/cancel/{tool_call_id}",
                                    {"reason": "Changed my mind"}, 1 - preferred)
            outcome = (tool_call_id, resumed.result(), cancelled.result())
        with self._lock:
            self.races.append(outcome)
            if outcome[2] == 200:
                self.cancelled.add(tool_call_id)
        return {}

    def waiting_problems(self, statuses: dict[str, str]) -> list[str]:
        """A call still waiting for what its caller already did: PENDING after its confirm was taken, or
        PREPARED (or PENDING) after its resume was (``statuses``: call -> its status now)."""
        with self._lock:
            confirmed, resumed = set(self.confirmed), set(self.resumed)
        return ([f"PENDING though its confirm was taken: {c}" for c in confirmed if statuses.get(c) == "PENDING"]
                + [f"{statuses[c]} though its resume was taken: {c}" for c in resumed
                   if statuses.get(c) in ("PENDING", "PREPARED")])

    def summary(self) -> str:
        cancelled = sum(1 for _i, _r, c in self.races if c == 200)
        with self._lock:
            mcp = sum(1 for a in self.answers if a.operation == "mcp_request")
        return (f"{super().summary()}, {mcp} of them over MCP, {self.failovers} sent again to the other API host, "
                f"{len(self.races)} resume/cancel races ({cancelled} cancelled), "
                f"tools {len(self.tools_used)}")


class Followers:
    """One thread per session id following its event stream across the API hosts."""

    def __init__(self, bases: list[str], auth: dict[str, str], sessions: int = STREAMS):
        """``sessions`` streams, opened on the API hosts in turn."""
        self.bases, self.auth = list(bases), auth
        self.events: dict[str, list[dict[str, Any]]] = defaultdict(list)  # session -> events as received
        self.resumed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: dict[str, Stream] = {}
        self.on_host: dict[str, int] = {}  # session -> the API host its stream is open on now
        self._threads = [threading.Thread(target=self._follow, args=(session_id(n), n % len(bases)), daemon=True)
                         for n in range(sessions)]

    def start(self) -> "Followers":
        for thread in self._threads:
            thread.start()
        return self

    def _follow(self, session: str, host: int) -> None:
        last: str | None = None
        while not self._stop.is_set():
            headers = {**self.auth, **({"Last-Event-ID": last} if last else {})}
            try:
                stream = Stream(f"{self.bases[host]}/voice-tools/events/{session}", headers)
                if stream.response.status_code == 429:
                    time.sleep(int(stream.response.headers.get("Retry-After", "1")))
                    continue
                if stream.response.status_code != 200:
                    raise RuntimeError(f"{stream.response.status_code} {stream.response.text[:200]}")
                with self._lock:
                    self._open[session] = stream
                    self.on_host[session] = host
                while not self._stop.is_set():
                    last, data = stream.next_event()
                    with self._lock:
                        self.events[session].append(data)
            except Exception as exc:  # noqa: BLE001 - the stream broke: open it again on the other host
                if self._stop.is_set():
                    return
                with self._lock:
                    self.on_host.pop(session, None)
                    self.resumed += 1
                    if len(self.errors) < 50:
                        self.errors.append(f"{session} on {self.bases[host]}: {type(exc).__name__}: {str(exc)[:120]}")
                host = 1 - host
                time.sleep(0.5)

    def received(self) -> int:
        with self._lock:
            return sum(len(events) for events in self.events.values())

    def wait_for(self, expected: dict[str, int], timeout: float) -> None:
        """Until each session's stream has received ``expected[session]`` events (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(len(self.events[s]) >= n for s, n in expected.items()):
                    return
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            streams = list(self._open.values())
        for stream in streams:
            _cut(stream)
        for thread in self._threads:
            thread.join(30)

    def problems(self, rows: dict[str, list[tuple[str, str, int]]]) -> list[str]:
        """Each stream against ``rows``: session -> [(event_id, tool_call_id, seq)] of its events."""
        found = []
        with self._lock:
            received = {s: list(events) for s, events in self.events.items()}
        for session, events in rows.items():
            got = received.get(session, [])
            ids = [e["event_id"] for e in got]
            twice = {i for i in ids if ids.count(i) > 1}
            if twice:
                found.append(f"stream {session}: {len(twice)} events twice, e.g. {sorted(twice)[:2]}")
            missing = {event_id for event_id, _c, _s in events} - set(ids)
            if missing:
                found.append(f"stream {session}: {len(missing)} of {len(events)} events never came, "
                             f"e.g. {sorted(missing)[:2]}")
            extra = set(ids) - {event_id for event_id, _c, _s in events}
            if extra:
                found.append(f"stream {session}: {len(extra)} events of no row of its session")
            by_call: dict[str, list[int]] = defaultdict(list)
            for event in got:
                by_call[event["tool_call_id"]].append(event["seq"])
            for tool_call_id, seqs in by_call.items():
                if seqs != list(range(1, len(seqs) + 1)):
                    found.append(f"stream {session}: {tool_call_id} came as seqs {seqs}")
        return found


def _cut(stream: Stream) -> None:
    """Shut the stream's socket down, so that the thread reading it wakes now."""
    raw = stream.response.raw
    conn = getattr(raw, "_connection", None) or getattr(raw, "connection", None)
    sock = getattr(conn, "sock", None)
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    stream.close()
