"""``python -m bench.stream``: 1,000 event streams open at once on one API process, then 200 waits held
beside them, measured in one run.

    .venv/bin/python -m bench.stream [--streams 1000] [--callers 4] [--waits 200] [--requests 300] [--rounds 2]

The Procfile's ``web`` line (gunicorn, one worker: the one process that serves every stream) and a
``celery -A tasks worker --pool prefork -c 2`` subprocess, on one database and one broker:

1. REST ``POST /voice-tools/pending`` p50 with no stream open (one client, keep-alive), before the
   streams and again after they closed (the two together are the reference);
2. ``--streams`` streams opened at once (asyncio sockets in a process of their own), spread over ``--callers``
   callers on the default shares, five streams per session; the worker process's PSS and RSS before and
   after, idle: the memory of an idle stream;
3. the same REST p50 with every stream open (goal: at most 1.2x the first);
4. ``--rounds`` ``search_contacts`` calls per session, one after the other (``/voice-tools/execute`` with a
   callback URL): each event's delay from its commit (its NOTIFY's arrival at a LISTEN connection, in a
   third process) to its arrival on each of its session's streams and at the callback receiver, each
   stamped when its bytes were read (goals, in the same run: stream p50 at most the callback's p50,
   stream p99 at most the callback's p99, over every arrival);
5. ``--waits`` ``?wait`` requests held at once by one more caller, beside the streams (each a replay of
   an ``execute`` whose call no worker moves, asked again as soon as it is answered: asyncio sockets in
   a process of their own): none refused; REST p50 again (goal: at most 1.2x the first), and ``--rounds``
   more calls per session, their events' delays to the streams against the callbacks' (the same goals).
Every stream must get exactly its session's events, in their order, none missed, none twice.

Results are printed and written to ``bench/STREAM.md``, and their summary to the "Event streams"
section of ``bench/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import STREAM_SECTION, bench_servers, machine  # noqa: E402

PER_SESSION = 5


def pct(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


# -- the API: the Procfile's web line, one worker ----------------------------------------------------

def web_line() -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith("web:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit("the Procfile has no web line")


def start_web(port: int, log_dir: Path, **env: str) -> subprocess.Popen:
    import requests

    metrics = log_dir / "prometheus"
    metrics.mkdir(exist_ok=True)
    environ = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), "WEB_CONCURRENCY": "1",
               "PROMETHEUS_MULTIPROC_DIR": str(metrics), "PYTHONPATH": str(ROOT),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env}
    log = open(log_dir / "web.log", "wb")
    # a session of its own, as the worker's (support/worker_process.py) and as a deployment's service: with the
    # kernel's autogroup scheduling, a session's processes share one CPU share, and the API's must not share
    # the bench's own (its relay, its stream client and its commit listener)
    proc = subprocess.Popen(["sh", "-c", f"exec {web_line()}"], cwd=ROOT, env=environ, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit((log_dir / "web.log").read_text(errors="replace"))
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        time.sleep(0.2)


def the_worker(master: int) -> int:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of ``pid`` in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return int(fields["Pss"].split()[0]), int(fields["Rss"].split()[0])


# -- the clients: asyncio sockets in a thread of their process ------------------------------------------

class OwnLoop:
    """A client's asyncio loop, run by a thread of its own; :meth:`close` cancels its tasks and stops it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)


class Follower(asyncio.Protocol):
    """One stream's connection: its answer's status, then each event's id with the instant its bytes were
    read from the socket (``data_received``, before any parsing: as the relay's body is stamped when read)."""

    def __init__(self, streams: "Streams", i: int) -> None:
        self.streams, self.i = streams, i
        self.data = b""  # read, not parsed yet
        self.text = ""  # the frames' text, not yet a whole block
        self.head = True
        self.done = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.data += data
        if self.head:
            if b"\r\n\r\n" not in self.data:
                return
            head, self.data = self.data.split(b"\r\n\r\n", 1)
            self.head = False
            self.streams.statuses[self.i] = int(head.split()[1])
            if b"transfer-encoding: chunked" not in head.lower() and not self.done.done():
                self.done.set_exception(AssertionError(head))
        while b"\r\n" in self.data:
            line, rest = self.data.split(b"\r\n", 1)
            size = int(line.strip() or b"0", 16)
            if size == 0:
                if not self.done.done():
                    self.done.set_result(None)
                return
            if len(rest) < size + 2:
                return
            self.text += rest[:size].decode()
            self.data = rest[size + 2:]
        while "\n\n" in self.text:
            block, self.text = self.text.split("\n\n", 1)
            if block.startswith(": voice-tools event stream"):
                self.streams.opened += 1
            for line in block.splitlines():
                if line.startswith("id: "):
                    self.streams.got[self.i].append((line[4:], now))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


class Streams(OwnLoop):
    """``count`` SSE connections read by one asyncio loop: per stream, the events' ids and arrival times."""

    def __init__(self, port: int, plan: list[tuple[str, str]]):
        self.port, self.plan = port, plan  # per stream: (token, session_id)
        self.statuses: list[int | None] = [None] * len(plan)
        self.opened = 0
        self.got: list[list[tuple[str, float]]] = [[] for _ in plan]
        self.tasks: list[Any] = []
        super().__init__()

    def open(self, timeout: float = 120.0) -> float:
        started = time.monotonic()
        self.tasks = [asyncio.run_coroutine_threadsafe(self._follow(i), self.loop) for i in range(len(self.plan))]
        while self.opened < len(self.plan):
            failed = [t.exception() for t in self.tasks if t.done() and t.exception()]
            if failed or time.monotonic() - started > timeout:
                raise SystemExit(f"{self.opened} streams opened; {failed[:3]} statuses {set(self.statuses)}")
            time.sleep(0.05)
        return time.monotonic() - started

    async def _follow(self, i: int) -> None:
        token, session_id = self.plan[i]
        transport, follower = await self.loop.create_connection(lambda: Follower(self, i), "127.0.0.1", self.port)
        try:
            transport.write(f"GET /voice-tools/events/{session_id} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                            f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n".encode())
            await follower.done
        finally:
            transport.close()

    def arrivals(self) -> list[list[tuple[str, float]]]:
        return self.got

    def answers(self) -> list[int | None]:
        return self.statuses

    def counts(self) -> list[int]:
        return [len(got) for got in self.got]


class Waits(OwnLoop):
    """``count`` ``?wait`` requests held at once, each asked again as soon as it is answered (the connection
    closes after each answer): how many were answered, by HTTP status, and how many are held now."""

    def __init__(self, port: int, token: str, bodies: list[bytes], wait_s: float):
        self.port, self.token, self.bodies, self.wait_s = port, token, bodies, wait_s
        self.statuses: dict[int, int] = defaultdict(int)
        self.answered_at: list[float] = []  # when each answer was read (for a closer look: VOICE_TOOLS_BENCH_RAW)
        self.held = 0
        self.running = True
        super().__init__()
        self.tasks = [asyncio.run_coroutine_threadsafe(self._hold(body), self.loop) for body in bodies]

    async def _hold(self, body: bytes) -> None:
        while self.running:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(f"POST /voice-tools/execute?wait={self.wait_s:g} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                         f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            self.held += 1
            try:
                answer = await reader.read()  # to the end: the answer closes the connection
            finally:
                self.held -= 1
                writer.close()
            self.answered_at.append(time.time())
            self.statuses[int(answer.split()[1]) if answer[:5] == b"HTTP/" else 0] += 1
            if answer[:5] == b"HTTP/" and int(answer.split()[1]) == 429:
                await asyncio.sleep(1.0)

    def holding(self) -> int:
        return self.held

    def answered(self) -> dict[int, int]:
        return dict(self.statuses)

    def answer_times(self) -> list[float]:
        return list(self.answered_at)

    def close(self) -> None:
        self.running = False
        super().close()


# -- the measurements -----------------------------------------------------------------------------------

def pending_ms(api: str, token: str, n: int) -> list[float]:
    import requests

    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {token}"
    body = {"session_id": "bench_stream_rest", "function": "send_email",
            "parameters": {"to": "bench@example.com", "subject": "Bench"}}
    ms = []
    for _ in range(n):
        started = time.perf_counter()
        answer = http.post(f"{api}/voice-tools/pending", json=body)
        ms.append((time.perf_counter() - started) * 1000)
        assert answer.status_code == 201, answer.text
    return ms


def run_calls(api: str, plan: list[tuple[str, str]], relay: Any, rounds: int) -> None:
    """``rounds`` calls per session, each once the previous one's ``completed`` callback came."""
    import requests

    http = requests.Session()
    for token, session_id in sorted(set(plan)) * rounds:
        started = http.post(f"{api}/voice-tools/execute", headers={"Authorization": f"Bearer {token}"}, json={
            "session_id": session_id, "function": "search_contacts", "parameters": {"query": "Ann"},
            "callback_url": relay.url})
        assert started.status_code == 202, started.text
        relay.wait_for(started.json()["tool_call_id"], "completed", timeout=60)


def calls_that_do_not_move(api: str, token: str, count: int) -> list[bytes]:
    """``count`` send_email calls started with ``/voice-tools/execute`` (and an idempotency key) on a queue no
    worker consumes: EXECUTING until the end; each one's request body, whose replay waits on it."""
    import json

    import requests

    http = requests.Session()
    bodies = []
    for k in range(count):
        body = json.dumps({"session_id": f"bench_waits_{k % 20}", "function": "send_email",
                           "parameters": {"to": "bench@example.com", "subject": "Bench"},
                           "idempotency_key": f"bench-wait-{k}"}).encode()
        started = http.post(f"{api}/voice-tools/execute", headers={"Authorization": f"Bearer {token}",
                                                                    "Content-Type": "application/json"}, data=body)
        assert started.status_code == 202, started.text
        bodies.append(body)
    return bodies


def wait_for_events(streams: Any, plan: list[tuple[str, str]], timeout: float = 60) -> dict[str, list[tuple[str, float]]]:
    """Each session's events (:func:`expected_events`), once every stream has them all (or ``timeout``)."""
    expected = expected_events(plan)
    want = [len(expected[session]) for _, session in plan]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(have < need for have, need in zip(streams.counts(), want)):
        time.sleep(0.5)
    return expected


class Commits:
    """When each event committed, as a LISTEN connection of this process sees it: PostgreSQL delivers a
    NOTIFY at its transaction's commit, the trigger sends one per event (with its session), in commit
    order; the k-th of a session is the session's k-th event."""

    def __init__(self, listen_url: str) -> None:
        import psycopg2

        self.seen: dict[str, list[float]] = defaultdict(list)
        self.conn = psycopg2.connect(listen_url)
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute("LISTEN voice_tools_events")
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import selectors

        from models import listen

        ready = selectors.DefaultSelector()
        ready.register(self.conn, selectors.EVENT_READ)
        while self.running:
            if ready.select(0.2):
                self.conn.poll()
                now = time.time()
                for note in self.conn.notifies:
                    self.seen[listen.notice_of(note.payload).session_id].append(now)
                self.conn.notifies.clear()

    def notified(self) -> dict[str, list[float]]:
        return dict(self.seen)

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.conn.close()


def apart(kind: type, *args: Any) -> tuple[Any, Any]:
    """``kind(*args)`` in a process of its own (a spawned multiprocessing manager), and the manager: the
    clients' timestamps are taken by processes that share no interpreter lock with the bench's relay,
    its requests or each other, as a relay's stream reader would be a program of its own."""
    import multiprocessing

    manager = Apart(ctx=multiprocessing.get_context("spawn"))
    manager.start()
    return getattr(manager, kind.__name__)(*args), manager


class Apart(BaseManager):
    """The manager process of :func:`apart`."""


Apart.register("Streams", Streams)
Apart.register("Commits", Commits)
Apart.register("Waits", Waits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--waits", type=int, default=200, help="?wait requests held at once by one more caller")
    parser.add_argument("--requests", type=int, default=300, help="REST pendings timed, each time (default 300)")
    parser.add_argument("--rounds", type=int, default=2, help="calls per session, each time events are measured")
    parser.add_argument("--output", default=str(ROOT / "bench" / "STREAM.md"))
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (args.streams + args.waits) + 500  # this process's client sockets, and the web worker's (it inherits this limit)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))

    callers = [(f"bench{k}", f"bench-stream-token-{k}") for k in range(args.callers)]
    waiter = ("bench-waits", "bench-waits-token")
    os.environ["VOICE_TOOLS_API_TOKENS"] = ",".join(f"{name}:{token}" for name, token in [*callers, waiter])
    os.environ["VOICE_TOOLS_CALLBACK_SECRET"] = "bench-callback-secret"
    for name in ("VOICE_TOOLS_CALLER_LIMITS", "VOICE_TOOLS_OPEN_PER_CALLER", "VOICE_TOOLS_OPEN_PER_PROCESS"):
        os.environ.pop(name, None)  # the default shares
    plan = [(callers[i % args.callers][1], f"bs{i % args.callers}_{i // (args.callers * PER_SESSION)}")
            for i in range(args.streams)]

    with bench_servers("voice-tools-bench-stream-") as data_dir:
        from tasks import app, tools
        from voice_tools_backends import load_demo
        from support.procs import free_port, stop_process
        from support.relay import Relay
        from support.worker_process import WorkerProcess

        load_demo()
        queues = [tools.TOOLS["search_contacts"].queue, "callbacks"]
        with app.connection_for_write() as conn:
            for name in queues:
                conn.default_channel.queue_purge(name)
        port = free_port()
        api = f"http://127.0.0.1:{port}"
        log_dir = Path(tempfile.mkdtemp(prefix="voice-tools-bench-stream-web-"))
        web = start_web(port, log_dir)
        try:
            with WorkerProcess(app, queues, pool="prefork", concurrency=2, log_dir=data_dir, name="bench-stream"), \
                    Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"]) as relay:
                worker = the_worker(web.pid)
                token = callers[0][1]
                pending_ms(api, token, 50)  # warm-up
                warm, warm_process = apart(Streams, port, plan[:10])
                warm.open()
                warm.close()
                warm_process.shutdown()
                time.sleep(1.0)
                print(f"REST pending, no stream open ({args.requests}) ...", flush=True)
                alone = pending_ms(api, token, args.requests)
                before = memory_kb(worker)
                print(f"opening {args.streams} streams ...", flush=True)
                streams, streams_process = apart(Streams, port, plan)
                took = streams.open()
                time.sleep(2.0)  # idle
                after = memory_kb(worker)
                statuses = set(streams.answers())
                print(f"REST pending, {args.streams} streams open ...", flush=True)
                loaded = pending_ms(api, token, args.requests)
                print(f"events: one call per session ({len(set(plan))}) ...", flush=True)
                from models import db

                commits, commits_process = apart(Commits, db.listen_url())
                run_calls(api, plan, relay, args.rounds)
                first = wait_for_events(streams, plan)
                first_ids = {event_id for events in first.values() for event_id, _ in events}
                print(f"holding {args.waits} waits from one caller ...", flush=True)
                bodies = calls_that_do_not_move(api, waiter[1], args.waits)
                waits, waits_process = apart(Waits, port, waiter[1], bodies, 30.0)
                deadline = time.monotonic() + 60
                while waits.holding() < args.waits and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(1.0)
                held = waits.holding()
                print(f"REST pending, {args.streams} streams open and {held} waits held ...", flush=True)
                loaded_waits = pending_ms(api, token, args.requests)
                print(f"events again, {held} waits held ...", flush=True)
                run_calls(api, plan, relay, args.rounds)
                expected = wait_for_events(streams, plan)
                held_after = waits.holding()
                answered = waits.answered()
                if os.environ.get("VOICE_TOOLS_BENCH_RAW"):  # when each wait was answered, for a closer look
                    Path(os.environ["VOICE_TOOLS_BENCH_RAW"] + ".waits").write_text(
                        "\n".join(f"{at:.6f}" for at in waits.answer_times()))
                waits.close()
                waits_process.shutdown()
                got = streams.arrivals()
                streams.close()
                notified = commits.notified()
                commits.close()
                streams_process.shutdown()
                commits_process.shutdown()
                time.sleep(1.0)
                print(f"REST pending, the streams closed ({args.requests}) ...", flush=True)
                alone += pending_ms(api, token, args.requests)
                arrived_cb: dict[str, float] = {}
                for event, read_at in zip(relay.events, relay.arrived):
                    arrived_cb.setdefault(event["event_id"], read_at)
        finally:
            stop_process(web)
        held_waits = (held, held_after, answered)
        text = report(args, alone, loaded, before, after, took, statuses, got, plan, expected, arrived_cb,
                      notified, first_ids, loaded_waits, held_waits)
    Path(args.output).write_text(text)
    results = ROOT / "bench" / "RESULTS.md"
    summary = summary_section(text)
    current = results.read_text()
    results.write_text(STREAM_SECTION.sub(lambda _: summary, current) if STREAM_SECTION.search(current) else current.rstrip("\n") + "\n" + summary)
    print(text)
    print(f"written to {args.output} and the summary to {results}")
    return 0


def expected_events(plan: list[tuple[str, str]]) -> dict[str, list[tuple[str, float]]]:
    """Each session's events in their stream order, with their rows' ``created_at``."""
    from sqlalchemy import text

    from models import db

    sessions = sorted({session for _, session in plan})
    found: dict[str, list[tuple[str, float]]] = defaultdict(list)
    with db.engine().connect() as conn:
        for row in conn.execute(text("SELECT session_id, event_id, created_at FROM callback_deliveries "
                                     "WHERE session_id = ANY(:s) ORDER BY commit_seq"), {"s": sessions}):
            found[row.session_id].append((row.event_id, row.created_at.timestamp()))
    return found


def report(args: argparse.Namespace, alone: list[float], loaded: list[float], before: tuple[int, int],
           after: tuple[int, int], took: float, statuses: set, arrivals: list[list[tuple[str, float]]],
           plan: list[tuple[str, str]],
           expected: dict[str, list[tuple[str, float]]], arrived_cb: dict[str, float],
           notified: dict[str, list[float]], first_ids: set[str], loaded_waits: list[float],
           held_waits: tuple[int, int, dict[int, int]]) -> str:
    recorded = {event_id: at for events in expected.values() for event_id, at in events}
    assert all(len(notified.get(session, [])) == len(events) for session, events in expected.items()), "a NOTIFY missing"
    committed = {event_id: notified[session][k] for session, events in expected.items()
                 for k, (event_id, _) in enumerate(events)}
    missed = duplicated = out_of_order = 0
    for i, (_, session) in enumerate(plan):
        got = [event_id for event_id, _ in arrivals[i]]
        want = [event_id for event_id, _ in expected[session]]
        missed += len(set(want) - set(got))
        duplicated += len(got) - len(set(got))
        out_of_order += got != want and sorted(got) == sorted(want)

    def delays(origin: dict[str, float], among: Any = None) -> tuple[list[float], list[float]]:
        """(each stream arrival's delay, each callback's), in ms from ``origin``'s instant of the event, for the
        events ``among`` picks (all when None)."""
        keep = (lambda e: e in origin) if among is None else (lambda e: e in origin and among(e))
        stream_ms = [(at - origin[e]) * 1000 for got in arrivals for e, at in got if keep(e)]
        return stream_ms, [(arrived_cb[e] - at) * 1000 for e, at in origin.items() if e in arrived_cb and keep(e)]

    stream_ms, callback_ms = delays(committed, lambda e: e in first_ids)
    stream_w, callback_w = delays(committed, lambda e: e not in first_ids)
    if os.environ.get("VOICE_TOOLS_BENCH_RAW"):  # every arrival, for a closer look
        import json

        Path(os.environ["VOICE_TOOLS_BENCH_RAW"]).write_text(json.dumps({
            "arrivals": [[i, e, at, committed[e]] for i, got in enumerate(arrivals) for e, at in got if e in committed],
            "callbacks": {e: [arrived_cb[e], at] for e, at in committed.items() if e in arrived_cb},
            "recorded": recorded, "first": sorted(first_ids)}))
    row_stream, row_callback = delays(recorded, lambda e: e in first_ids)
    n = args.streams
    pss, rss = (after[0] - before[0]) / n, (after[1] - before[1]) / n
    rest_ratio = statistics.median(loaded) / statistics.median(alone)
    rest_waits_ratio = statistics.median(loaded_waits) / statistics.median(alone)
    held, held_after, answered = held_waits
    refused = answered.get(429, 0)
    info = machine()

    def ok(good: bool) -> str:
        return "met" if good else "**not met**"

    def against_callback(stream: list[float], callback: list[float], when: str) -> list[str]:
        s50, s99, c50, c99 = statistics.median(stream), pct(stream, 99), statistics.median(callback), pct(callback, 99)
        return [
            f"| {when}: an event's delay from its commit to the stream, p50 / p99 (ms; {len(stream)} arrivals of "
            f"{len(callback)} events) | {s50:.1f} / {s99:.1f} | | |",
            f"| {when}: the same to the callback, p50 / p99 (ms) | {c50:.1f} / {c99:.1f} | | |",
            f"| {when}: stream p50 against the callback's p50 | **{s50 / c50:.2f}x** | at most 1x | {ok(s50 <= c50)} |",
            f"| {when}: stream p99 against the callback's p99 | **{s99 / c99:.2f}x** | at most 1x | {ok(s99 <= c99)} |",
        ]

    return "\n".join([
        "# voice-tools event stream benchmark",
        "",
        f"- measured on {datetime.now(timezone.utc).strftime('%Y-%m-%d')} with `.venv/bin/python -m bench.stream "
        f"--streams {n} --callers {args.callers} --waits {args.waits} --requests {args.requests} "
        f"--rounds {args.rounds}`",
        f"- machine: {info['cpu']}; {info['os']}; Python {info['python']}",
        f"- {info['versions']}; servers {info['servers']}",
        f"- {info['load']}",
        f"- the Procfile's web line, one gunicorn worker (8 threads), serving every stream and wait on the default "
        f"shares; {n} streams over {args.callers} callers, {PER_SESSION} per session, opened in {took:.1f} s "
        f"(answers: {sorted(statuses)}); then {args.waits} waits from one more caller beside them",
        "",
        f"## Event streams: {n:,} open on one API process, then {args.waits} waits held",
        "",
        "| measurement | value | goal | |",
        "|---|---|---|---|",
        f"| REST `pending` p50, no stream open, before and after (ms) | {statistics.median(alone[:len(loaded)]):.2f}"
        f", {statistics.median(alone[len(loaded):]):.2f} | | |",
        f"| REST `pending` p50, {n} streams open (ms) | {statistics.median(loaded):.2f} | | |",
        f"| ratio | **{rest_ratio:.2f}x** | at most 1.2x | {ok(rest_ratio <= 1.2)} |",
        f"| events missed / duplicated / out of order, over {n} streams | {missed} / {duplicated} / {out_of_order} "
        f"| 0 / 0 / 0 | {ok(missed == duplicated == out_of_order == 0)} |",
        *against_callback(stream_ms, callback_ms, f"{n} streams open"),
        f"| from the row's `created_at` instead: stream p50 / p99, callback p50 / p99 (ms) "
        f"| {statistics.median(row_stream):.1f} / {pct(row_stream, 99):.1f}, {statistics.median(row_callback):.1f}"
        f" / {pct(row_callback, 99):.1f} | | |",
        f"| memory per idle stream, PSS / RSS of the worker (KB) | **{pss:.1f}** / {rss:.1f} | at most 50 | "
        f"{ok(pss <= 50 and rss <= 50)} |",
        f"| waits held by one caller, when measured and at the end; answers refused (429) | {held}, {held_after}; "
        f"{refused} of {sum(answered.values())} | {args.waits}; 0 | {ok(held >= args.waits and refused == 0)} |",
        f"| REST `pending` p50, {n} streams open and {held} waits held (ms) | {statistics.median(loaded_waits):.2f} "
        f"| | |",
        f"| ratio | **{rest_waits_ratio:.2f}x** | at most 1.2x | {ok(rest_waits_ratio <= 1.2)} |",
        *against_callback(stream_w, callback_w, f"{held} waits held"),
        "",
        "An event's commit is when a LISTEN connection of the bench received its NOTIFY (PostgreSQL delivers "
        f"it at the commit); {args.rounds} calls per session each time, one after the other; an arrival is "
        "stamped when its bytes were read, on a stream as at the callback receiver; the callback is posted by "
        "the link right after its commit; a stream gets the "
        "event from the NOTIFY the API's own listener hears at the commit (it reads the table only for an event "
        "too large for a notification). From the row's `created_at` (the start of "
        "the recording transaction), both delays also carry that transaction's own time. The waits are replays "
        "of `execute` on calls no worker moves, each asked again as soon as it is answered (after 30 s).",
        "",
    ])


def summary_section(text: str) -> str:
    return "\n" + text[text.index("## Event streams: "):].rstrip("\n") + "\n\nFull figures: [STREAM.md](STREAM.md) (`python -m bench.stream`).\n"


if __name__ == "__main__":
    sys.exit(main())
