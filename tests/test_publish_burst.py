"""A burst of starts never wedges the publishing path: more starts at once than the broker's producer pool
holds (``broker_pool_limit``), from the MCP face and REST together, while the Celery workers are stopped
(as during a worker restart), are each answered, the caller's wait slots all given back, and the API
answers as before once the workers are back. The layout is ``voice-tools run``'s (``Procfile.local``: one
gunicorn worker that also serves the MCP face), started fresh, so the starts are its first publishes.
In one process, the same from the pool's side: a start publishes with one producer and waits for no
second, and a start that finds every producer taken is a 503 with ``Retry-After`` within the pool's
acquire timeout, never a hang."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
import requests

from app import shares
from support.procs import free_port
from support.worker_process import WorkerProcess, queues_taken_from_others
from tasks import tools
from tests.api_fixtures import snapshot
from tests.conftest import API_TOKEN, AUTH
from tests.web_server import gunicorn_web


MCP_STARTS = 60  # above the MCP face's 16 threads and the pool's 10 producers
REST_STARTS = 16  # above the gunicorn worker's 8 threads
CALLER = "tests"  # the name of API_TOKEN (tests/conftest.py)
SEARCH = {"function": "search_contacts", "parameters": {"query": "john"}}


class FarBroker:
    """A TCP front for the run's Redis whose every new connection is answered only after ``delay`` seconds,
    as a broker far away: a fresh process's first publishes, each connecting, overlap."""

    def __init__(self, url: str, delay: float = 0.3) -> None:
        parts = urlsplit(url)
        self.upstream = (socket.AF_UNIX, parts.path) if parts.scheme in ("redis+socket", "unix") else \
            (socket.AF_INET, (parts.hostname, parts.port or 6379))
        self.database = parts.path.lstrip("/") if self.upstream[0] == socket.AF_INET else "0"
        self.delay = delay
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/{self.database or 0}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        time.sleep(self.delay)
        with client, socket.socket(self.upstream[0], socket.SOCK_STREAM) as upstream:
            try:
                upstream.connect(self.upstream[1])
                ends = {client: upstream, upstream: client}
                while True:
                    ready, _, _ = select.select(list(ends), [], [], 60)
                    for end in ready:
                        data = end.recv(65536)
                        if not data:
                            return
                        ends[end].sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()


def mcp_execute(url: str, session: str, wait: int) -> int | str:
    """One MCP ``execute_tool`` with ``wait``: the operation's HTTP status, or what came back instead."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "execute_tool", "arguments": {"session_id": session, **SEARCH, "wait": wait}}}
    try:
        answer = requests.post(f"{url}/mcp", data=json.dumps(body), timeout=wait + 40, headers={
            "Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream", "Connection": "close"})
    except requests.RequestException as exc:
        return type(exc).__name__
    found = re.search(r'"voice-tools/http_status":\s*(\d+)', answer.text)
    return int(found.group(1)) if found else f"HTTP {answer.status_code}: {answer.text[:200]}"


def rest_execute(url: str, session: str) -> int | str:
    try:
        return requests.post(f"{url}/voice-tools/execute", json={"session_id": session, **SEARCH}, headers=AUTH,
                             timeout=40).status_code
    except requests.RequestException as exc:
        return type(exc).__name__


def open_slots() -> int:
    """The wait slots the caller holds, over every API process (app/shares.py counts them in Redis)."""
    return shares.counts().client.zcard(f"{shares.KEY_PREFIX}:open:{CALLER}")


def answered_within(seconds: float, request):
    """``request()``'s answer, on a thread of its own; ``"hung"`` when it has none after ``seconds``."""
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(request()), daemon=True)
    thread.start()
    thread.join(seconds)
    return answer[0] if answer else "hung"


@contextmanager
def producers_taken(app, how_many: int):
    """``how_many`` of the Celery app's pooled producers held, as other threads publishing would hold them."""
    taken = [app.producer_pool.acquire(block=False) for _ in range(how_many)]
    try:
        yield
    finally:
        for producer in taken:
            producer.release()


@pytest.fixture
def client():
    """The REST API (a test client kept out of ``with``: its requests are made on threads of their own)."""
    from app import create_app

    return create_app({"TESTING": True}).test_client()


def test_a_start_publishes_with_the_one_producer_it_takes(client, celery_app_instance):
    """Every producer but one taken by others: the start takes the last, publishes its chain with it and
    answers, waiting for no second producer."""
    app = celery_app_instance
    with producers_taken(app, app.conf.broker_pool_limit - 1):
        answer = answered_within(20, lambda: client.post("/voice-tools/execute", headers=AUTH,
                                                         json={"session_id": "one-producer", **SEARCH}))
    assert answer != "hung", "the start waited for a second producer while holding one"
    assert answer.status_code == 202, answer.get_json()


def test_a_start_that_finds_every_producer_taken_is_503_with_retry_after(client, celery_app_instance):
    app = celery_app_instance
    with producers_taken(app, app.conf.broker_pool_limit):
        answer = answered_within((app.conf.broker_pool_acquire_timeout or 20) + 10, lambda: client.post(
            "/voice-tools/execute", headers=AUTH, json={"session_id": "no-producer", **SEARCH}))
    assert answer != "hung", "the start waited for a producer without a bound"
    assert answer.status_code == 503, answer.get_json()
    assert answer.get_json()["error"] == "unavailable"
    assert answer.get_json()["details"]["service"] == "broker"
    assert int(answer.headers["Retry-After"]) >= 1
    [stored] = snapshot()["tool_calls"]  # recorded, then given back: a replay starts it
    assert stored["status"] == "PENDING"


def _outcome(publish):
    def run():
        try:
            publish()
            return "published"
        except Exception as exc:  # noqa: BLE001 - which error it is, is the assertion
            return exc
    return run


def test_a_callback_dispatch_that_finds_every_producer_taken_is_refused_within_the_bound(celery_app_instance):
    """A callback's dispatch (a face's, an operator's redelivery) publishes on the one path too: with every
    pooled connection taken it is kombu's OperationalError after the acquire timeout (the face leaves the event
    to the retry sweep), never a wait for ever; and with one free it publishes."""
    from kombu.exceptions import OperationalError

    from tasks.delivery import attempts

    app = celery_app_instance
    bound = (app.conf.broker_pool_acquire_timeout or 20) + 10
    with producers_taken(app, app.conf.broker_pool_limit):
        outcome = answered_within(bound, _outcome(lambda: attempts.dispatch("ev_no_producer")))
        assert outcome != "hung", "the dispatch waited for a connection without a bound"
        assert isinstance(outcome, OperationalError), outcome
        quiet = answered_within(bound, _outcome(lambda: attempts.dispatch_quietly(
            attempts.CallbackDelivery(event_id="ev_no_producer"))))
        assert quiet == "published"  # nothing raised: left to the retry sweep
    with producers_taken(app, app.conf.broker_pool_limit - 1):
        assert answered_within(bound, _outcome(lambda: attempts.dispatch("ev_one_producer"))) == "published"


@pytest.mark.fault
@pytest.mark.slow
def test_a_burst_of_starts_beyond_the_producer_pool_is_answered_with_the_workers_stopped(celery_app_instance,
                                                                                         tmp_path):
    app = celery_app_instance
    queue = tools.TOOLS["search_contacts"].queue
    mcp_port = free_port()
    assert open_slots() == 0
    far = FarBroker(os.environ["CELERY_BROKER_URL"])
    with queues_taken_from_others(app, [queue]), \
            WorkerProcess(app, [queue], concurrency=1, log_dir=tmp_path) as worker, \
            gunicorn_web("Procfile.local", MCP_PORT=str(mcp_port), CELERY_BROKER_URL=far.url) as url:
        mcp_url = f"http://127.0.0.1:{mcp_port}"
        assert requests.get(f"{mcp_url}/healthz", timeout=10).status_code == 200  # the face is loaded
        answers: dict[str, int | str] = {}
        go = threading.Barrier(MCP_STARTS + REST_STARTS)

        def start(kind: str, index: int) -> None:
            go.wait(30)
            answers[f"{kind}{index}"] = (mcp_execute(mcp_url, f"burst-mcp-{index}", 10) if kind == "mcp"
                                         else rest_execute(url, f"burst-rest-{index}"))

        threads = [threading.Thread(target=start, args=("mcp", i), daemon=True) for i in range(MCP_STARTS)]
        threads += [threading.Thread(target=start, args=("rest", i), daemon=True) for i in range(REST_STARTS)]
        os.killpg(worker.pid, signal.SIGSTOP)  # the worker and its pool child: nothing runs the chains
        try:
            for thread in threads:
                thread.start()
            time.sleep(5)
            try:
                meanwhile: int | str = requests.get(f"{url}/healthz", timeout=10).status_code
            except requests.RequestException as exc:
                meanwhile = type(exc).__name__
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        for thread in threads:
            thread.join(90)
        mcp = sorted(str(answers.get(f"mcp{i}", "unanswered")) for i in range(MCP_STARTS))
        rest = sorted(str(answers.get(f"rest{i}", "unanswered")) for i in range(REST_STARTS))
        assert meanwhile == 200
        assert set(mcp) <= {"200", "202"}, mcp  # each wait answered: done, or still running when it ended
        assert set(rest) == {"202"}, rest
        # the face and REST answer as before, and publish
        assert rest_execute(url, "after-rest") == 202
        assert mcp_execute(mcp_url, "after-mcp", 10) in (200, 202)
        deadline = time.monotonic() + 15
        while open_slots() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert open_slots() == 0  # every wait gave its slot back
    far.close()
