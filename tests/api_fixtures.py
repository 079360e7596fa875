"""Fixtures and helpers for the API tests: a test client of ``create_app()`` and
snapshots of the tables so an error test can show that nothing changed."""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

import pytest
from sqlalchemy import text

from models import db
from tests.conftest import AUTH

GUIDE_EMAIL = {"to": "test@example.com", "subject": "Test"}


@pytest.fixture
def client():
    from app import create_app

    app = create_app({"TESTING": True})
    with app.test_client() as test_client:
        yield test_client


def snapshot() -> dict[str, list[dict[str, Any]]]:
    """Every row of every table (the backends' too), in a stable order."""
    from tests.conftest import tables

    with db.engine().connect() as conn:
        return {name: sorted((dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name}"))), key=repr)
                for name in tables()}


def call_count() -> int:
    with db.engine().connect() as conn:
        return conn.execute(text("SELECT count(*) FROM tool_calls")).scalar_one()


def pending(client, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None):
    """POST /voice-tools/pending with the body of docs/relay-guide.md's first curl by default."""
    payload = body if body is not None else {"session_id": "test_123", "function": "send_email",
                                             "parameters": dict(GUIDE_EMAIL)}
    return client.post("/voice-tools/pending", json=payload, headers=headers or AUTH)


def created_id(client, **body: Any) -> str:
    payload = {"session_id": "test_123", "function": "send_email", "parameters": dict(GUIDE_EMAIL)}
    payload.update(body)
    answer = pending(client, payload)
    assert answer.status_code == 201, answer.get_json()
    return answer.get_json()["tool_call_id"]


CLOSED_PORT_BROKER = "redis://127.0.0.1:1/0"
CLOSED_PORT_DATABASE = "postgresql://nobody@127.0.0.1:1/nothing"


class BrokerDown:
    """Points the Celery app's producers at a closed port until :meth:`restore`.

    ``app.pool`` and ``app.amqp.producer_pool`` are made from ``conf.broker_url`` on
    first use, so clearing them makes the next publish connect to the closed port.
    Request it after ``worker`` so the worker's own set-up sees the real broker.
    """

    def __init__(self, celery_app):
        self.app = celery_app
        self.saved = (celery_app.conf.broker_url, celery_app.conf.broker_write_url,
                      celery_app._pool, celery_app.amqp._producer_pool)
        celery_app.conf.broker_url = CLOSED_PORT_BROKER
        celery_app.conf.broker_write_url = CLOSED_PORT_BROKER
        celery_app._pool = None
        celery_app.amqp._producer_pool = None

    def restore(self) -> None:
        if self.saved is None:
            return
        (self.app.conf.broker_url, self.app.conf.broker_write_url,
         self.app._pool, self.app.amqp._producer_pool) = self.saved
        self.saved = None


class LostPublishAnswer:
    """The next chain this thread publishes reaches the real broker, but its answer is "lost".

    The publish goes through (the worker gets the message and runs the chain), then the
    call does not return until ``settled()`` holds and raises the error a connection
    dropped before the broker's reply raises. Only the first publish of the thread that
    made this object is affected; the in-process worker's own publishes (its next links,
    its callbacks) are not. A chain is published on the producer of
    ``tasks.publishing.producer`` (``tasks/chains.py``, ``enqueue``): that is the one
    replaced. Undo with :meth:`restore`.
    """

    def __init__(self, celery_app, settled: Callable[[], bool], timeout: float = 15.0):
        from tasks import publishing

        self.publishing, self.settled, self.timeout = publishing, settled, timeout
        self.thread = threading.get_ident()
        self.published = 0
        self._real = publishing.producer
        publishing.producer = self._producer

    def _lossy(self) -> bool:
        return not self.published and threading.get_ident() == self.thread

    @contextmanager
    def _producer(self, *args: Any, **kwargs: Any):
        with self._real(*args, **kwargs) as given:
            if not self._lossy():
                yield given
                return
            real_publish = given.publish

            def publish(*args: Any, **kwargs: Any):
                from kombu.exceptions import OperationalError

                if (kwargs.get("headers") or {}).get("task", "").startswith("callbacks."):
                    return real_publish(*args, **kwargs)  # a callback's dispatch: not the chain's publish
                real_publish(*args, **kwargs)
                self.published += 1
                deadline = time.monotonic() + self.timeout
                while not self.settled():
                    assert time.monotonic() < deadline, "the published chain never got where the test waits"
                    time.sleep(0.02)
                raise OperationalError("Connection reset by peer (the broker's answer was lost)")

            given.publish = publish
            yield given

    def restore(self) -> None:
        self.publishing.producer = self._real


@pytest.fixture
def lost_publish_answer():
    """``lost_publish_answer(settled)``: the test thread's next chain publish loses its answer (see above)."""
    from tasks import app as celery_app

    made: list[LostPublishAnswer] = []

    def _make(settled: Callable[[], bool]) -> LostPublishAnswer:
        made.append(LostPublishAnswer(celery_app, settled))
        return made[-1]

    yield _make
    for lost in made:
        lost.restore()


@pytest.fixture
def broker_down():
    from tasks import app as celery_app

    down = BrokerDown(celery_app)
    try:
        yield down
    finally:
        down.restore()


@pytest.fixture
def database_down(monkeypatch):
    """A context manager: inside it this process's engine points at a closed port."""
    from contextlib import contextmanager

    @contextmanager
    def down():
        real = os.environ["DATABASE_URL"]
        db.dispose()
        monkeypatch.setenv("DATABASE_URL", CLOSED_PORT_DATABASE)
        try:
            yield
        finally:
            monkeypatch.setenv("DATABASE_URL", real)
            db.dispose()

    return down


@contextmanager
def served_api():
    """The API in a real threaded HTTP server (werkzeug) on a free port; its base URL."""
    from werkzeug.serving import make_server

    from app import create_app

    server = make_server("127.0.0.1", 0, create_app(), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


@pytest.fixture
def api_url():
    """The API in a real threaded HTTP server (werkzeug) on a free port: for streams and HTTP clients."""
    with served_api() as url:
        yield url
