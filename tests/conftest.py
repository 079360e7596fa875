"""Test set-up: real PostgreSQL and Redis, real Celery workers.

Each embedded server starts once per run (under the system temp folder), in the session
fixture ``database_and_broker`` that every test uses, so collecting the tests starts nothing; when
``DATABASE_URL`` / ``REDIS_URL`` are set those servers are used instead (the tests
create and migrate their own database ``voice_tools_test`` there; under pytest-xdist each worker
process has its own servers, or its own database and Redis database number). The Celery app reads
its broker from ``CELERY_BROKER_URL`` when it connects, so the test modules may import it
before the servers start. Every test gets clean tables; tests that need a worker take the
``worker`` fixture (an in-process Celery worker consuming every queue).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

pytest_plugins = ("celery.contrib.pytest", "tests.api_fixtures", "tests.google_fixtures")

# Under pytest-xdist (README: -n 3) each worker process is a run of its own: embedded servers of its
# own, or, on servers given by DATABASE_URL / REDIS_URL, a database and a Redis database number of its own.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...; empty without xdist
TEST_DATABASE = "voice_tools_test" + (f"_{XDIST_WORKER}" if XDIST_WORKER else "")
API_TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}

os.environ.setdefault("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN}")
os.environ.setdefault("VOICE_TOOLS_CALLBACK_SECRET", "test-callback-secret")
# Standard Webhooks (whsec_ + base64 of 32 bytes): every callback of the tests carries both schemes
os.environ.setdefault("VOICE_TOOLS_CALLBACK_SECRETS", "whsec_dGVzdC1jYWxsYmFjay1zZWNyZXQtb2YtMzItYnl0ZXM=")
os.environ.setdefault("VOICE_TOOLS_CALLBACK_HOSTS", "127.0.0.1,localhost")
os.environ.setdefault("VOICE_TOOLS_CALLBACK_TIMEOUT", "2")

def _point_at_test_database(url: str) -> str:
    """Create ``voice_tools_test`` on the server of ``url``; return its URL."""
    from voice_tools import servers

    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    servers.create_database(admin, TEST_DATABASE, drop=True)
    return urlunsplit(parts._replace(path=f"/{TEST_DATABASE}"))


def _redis_database_of_this_worker(url: str) -> str:
    """``url`` with the Redis database number 1 + this xdist worker's number (gw0 -> /1, gw1 -> /2 ...)."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{1 + int(XDIST_WORKER.removeprefix('gw'))}"))


def _no_fsync(url: str) -> None:
    """The run's own throwaway PostgreSQL skips fsync (PostgreSQL's docs: fine where the data can be
    made again): each test's TRUNCATE and every commit cost a disk flush otherwise. Nothing is lost
    when a test stops the server (a clean shutdown writes everything) or kills a process; only
    the machine crashing would. Never set on a server given by ``DATABASE_URL``, nor in the
    benchmarks."""
    import psycopg2

    conn = psycopg2.connect(url)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("ALTER SYSTEM SET fsync = off")
            cur.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()


@pytest.fixture(scope="session", autouse=True)
def database_and_broker():
    """This run's PostgreSQL and Redis (embedded, unless the variables name servers), migrated;
    stopped and removed when the run ends."""
    from voice_tools import servers as embedded

    data_dir = Path(tempfile.mkdtemp(prefix="voice-tools-tests-", dir=tempfile.gettempdir()))
    try:
        if os.environ.get("DATABASE_URL"):
            os.environ["DATABASE_URL"] = _point_at_test_database(os.environ["DATABASE_URL"])
        else:
            os.environ["DATABASE_URL"] = embedded.start_postgres(data_dir, TEST_DATABASE)
            _no_fsync(os.environ["DATABASE_URL"])
        if not (os.environ.get("REDIS_URL") or os.environ.get("CELERY_BROKER_URL")):
            os.environ["REDIS_URL"] = embedded.start_redis(data_dir / "redis")
        elif XDIST_WORKER:
            for name in ("REDIS_URL", "CELERY_BROKER_URL"):
                if os.environ.get(name, "").startswith("redis://"):
                    os.environ[name] = _redis_database_of_this_worker(os.environ[name])
        os.environ.setdefault("CELERY_BROKER_URL", os.environ.get("REDIS_URL", ""))
        embedded.migrate()
        yield
    finally:
        embedded.stop_servers()
        shutil.rmtree(data_dir, ignore_errors=True)


def tables() -> list[str]:
    """Every table of the schema but Alembic's: the backends' tables come and go with their migrations."""
    from sqlalchemy import inspect

    from models import db

    return [t for t in inspect(db.engine()).get_table_names() if t != "alembic_version"]


@pytest.fixture(scope="session")
def schema_tables(database_and_broker) -> tuple[str, ...]:
    """The tables of the migrated schema, read once."""
    return tuple(tables())


@pytest.fixture(autouse=True)
def clean_database(schema_tables):
    """Every test starts with empty tables (and no caller's fair share used). Only the tables that
    hold rows are truncated: a TRUNCATE makes each table's and index's files anew, about 10 ms a
    table, and most tests fill two or three of them."""
    from sqlalchemy import text

    from models import db

    holding = " UNION ALL ".join(f"SELECT '{t}' WHERE EXISTS (SELECT 1 FROM {t})" for t in schema_tables)
    with db.engine().begin() as conn:
        dirty = conn.execute(text(holding)).scalars().all()
        if dirty:
            conn.execute(text(f"TRUNCATE {', '.join(dirty)} RESTART IDENTITY CASCADE"))
    clear_shares()
    yield


@pytest.fixture(autouse=True)
def clean_log_context():
    """Every test starts with no log context bound, and leaves none: an operation called outside a
    request (a helper recording a call) adds its call's ids for "the rest of the request", which on a
    test's thread is every later test of the process (``models/logs.py``)."""
    from models import logs

    token = logs.bind()
    yield
    logs.reset(token)


def clear_shares() -> None:
    """Every test starts with no caller's share used (app/shares.py): a stream an earlier test dropped
    holds its slot until its server writes to it again (or, its server stopped, until its lease lapses)."""
    from app import shares

    counts = shares.counts()
    if counts.client is not None:
        keys = list(counts.client.scan_iter(match=f"{shares.KEY_PREFIX}:*", count=1000))
        if keys:
            counts.client.delete(*keys)


@pytest.fixture(scope="session")
def celery_app_instance(database_and_broker):
    from tasks import app

    return app


def purge_queues(app) -> None:
    with app.connection_for_write() as conn:
        for queue in app.conf.task_queues:
            try:
                queue.bind(conn.default_channel).purge()
            except Exception:
                pass


@pytest.fixture(scope="session")
def _session_worker(celery_app_instance):
    """One in-process worker (4 threads) for the whole run, consuming every queue."""
    from celery.contrib.testing.worker import start_worker

    app = celery_app_instance
    purge_queues(app)
    with start_worker(
        app,
        pool="threads",
        concurrency=4,
        perform_ping_check=False,
        shutdown_timeout=30,
        loglevel="WARNING",
        queues=[q.name for q in app.conf.task_queues],
    ) as worker:
        yield worker


@pytest.fixture
def worker(_session_worker, celery_app_instance):
    """A running worker; queues are purged before the test."""
    purge_queues(celery_app_instance)
    yield _session_worker


@pytest.fixture
def relay():
    """A real HTTP receiver that checks both schemes' signatures and records every event."""
    from support.relay import Relay
    from tasks.delivery.signing import parse_secrets

    with Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"],
               webhook_secrets=parse_secrets(os.environ.get("VOICE_TOOLS_CALLBACK_SECRETS", ""))) as receiver:
        yield receiver
