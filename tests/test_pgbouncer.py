"""The system through PgBouncer in transaction mode (docs/operations.md, PgBouncer).

The test starts its own ``pgbouncer`` (Debian package) in front of this run's PostgreSQL, with
``pool_mode = transaction``, then runs a real API (gunicorn, ``DATABASE_URL`` = the bouncer,
``DATABASE_LISTEN_URL`` = PostgreSQL itself) and a real Celery worker (``DATABASE_URL`` = the
bouncer) through relay scenarios: send_email pending → confirm ``?wait`` → PREPARED → resume
``?wait`` → COMPLETED with its callbacks at the relay, the session's event stream, and a cancel.
Then it shows where each process's connections go: the API's and the worker's queries through
the bouncer (its admin console counts their transactions), and only the API's LISTEN connection
straight to PostgreSQL.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg2
import psycopg2.extensions
import pytest
import requests

from support.procs import free_port, process_family, wait_listening
from support.sse_client import Stream
from support.worker_process import WorkerProcess, queues_taken_from_others
from tests.api_fixtures import GUIDE_EMAIL
from tests.conftest import AUTH
from tests.web_server import gunicorn_web

PGBOUNCER = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed (Debian: apt-get install pgbouncer)"),
]


@contextmanager
def pgbouncer(database_url: str) -> Iterator[tuple[str, int]]:
    """A pgbouncer in transaction mode in front of ``database_url``'s server; yields (its URL for the same
    database, its port). Its ini, log and pid file are in a folder of its own; stopped at the end."""
    dsn = psycopg2.extensions.parse_dsn(database_url)
    user, dbname = dsn.get("user", "postgres"), dsn["dbname"]
    port = free_port()
    runs_as = None  # pgbouncer will not run as root: as root, it runs as the server's own user
    if os.geteuid() == 0:
        host = dsn.get("host", "")
        runs_as = pwd.getpwuid(Path(host).stat().st_uid).pw_name if host.startswith("/") else "postgres"
    scratch = Path(tempfile.mkdtemp(prefix="voice-tools-pgbouncer-"))
    target = f"host={dsn.get('host', '127.0.0.1')} port={dsn.get('port', 5432)} dbname={dbname} user={user}"
    if dsn.get("password"):
        target += f" password={dsn['password']}"
    (scratch / "userlist.txt").write_text(f'"{user}" "{dsn.get("password", "")}"\n')
    ini = scratch / "pgbouncer.ini"
    ini.write_text("\n".join([
        "[databases]",
        f"{dbname} = {target}",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "auth_type = trust",
        f"auth_file = {scratch / 'userlist.txt'}",
        f"admin_users = {user}",
        "pool_mode = transaction",
        "default_pool_size = 10",
        "max_client_conn = 200",
        f"logfile = {scratch / 'pgbouncer.log'}",
        f"pidfile = {scratch / 'pgbouncer.pid'}",
        *([f"user = {runs_as}"] if runs_as else []),
        "",
    ]))
    if runs_as:
        shutil.chown(scratch, runs_as)
        for f in scratch.iterdir():
            shutil.chown(f, runs_as)
    proc = subprocess.Popen([PGBOUNCER, str(ini)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        assert wait_listening(port, timeout=20), (scratch / "pgbouncer.log").read_text(errors="replace")
        yield f"postgresql://{user}@127.0.0.1:{port}/{dbname}", port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)


def admin(port: int, user: str, command: str) -> list[dict]:
    """A ``SHOW ...`` of the bouncer's admin console, as dicts."""
    conn = psycopg2.connect(host="127.0.0.1", port=port, dbname="pgbouncer", user=user)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(command)
            names = [c.name for c in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        conn.close()


def peers(pids: list[int]) -> dict[int, list[int]]:
    """The remote ports of the established TCP connections of the processes ``pids``, by pid."""
    found: dict[int, list[int]] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        found[pid] = [c.raddr.port for c in conns if c.raddr and c.status == psutil.CONN_ESTABLISHED]
    return found


def web_processes(base_url: str) -> list[int]:
    """The gunicorn processes (arbiter and workers) listening on the port of ``base_url``."""
    port = int(base_url.rsplit(":", 1)[1])
    for proc in psutil.process_iter():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in proc.net_connections(kind="tcp")):
                return [proc.pid] + [c.pid for c in proc.children(recursive=True)]
        except psutil.Error:
            continue
    raise AssertionError(f"nothing listens on {port}")


def with_application_name(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query="&".join(filter(None, [parts.query, f"application_name={name}"]))))


def backends(url: str) -> list[tuple[int, str, str]]:
    """``(pid, application_name, query)`` of every other connection to ``url``'s database."""
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pid, application_name, query FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()")
            return cur.fetchall()
    finally:
        conn.close()


def test_the_system_runs_through_pgbouncer_in_transaction_mode_and_only_listen_connects_directly(
        celery_app_instance, relay, tmp_path):
    direct = os.environ["DATABASE_URL"]
    listen = with_application_name(direct, "voice-tools-listen")  # whatever uses this URL is seen as such
    dsn = psycopg2.extensions.parse_dsn(direct)
    user = dsn.get("user", "postgres")
    queues = [q.name for q in celery_app_instance.conf.task_queues]
    with pgbouncer(direct) as (bounced, bouncer_port), \
            queues_taken_from_others(celery_app_instance, queues), \
            WorkerProcess(celery_app_instance, queues, concurrency=1, log_dir=tmp_path, name="bounced",
                          env={"DATABASE_URL": bounced}) as worker, \
            gunicorn_web(DATABASE_URL=bounced, DATABASE_LISTEN_URL=listen, WEB_CONCURRENCY="1") as url:
        stream = Stream(f"{url}/voice-tools/events/sess_bouncer", AUTH)
        assert stream.response.status_code == 200

        # send_email, walked through with ?wait: PENDING, PREPARED, COMPLETED; callbacks at the relay
        created = requests.post(f"{url}/voice-tools/pending", headers=AUTH, timeout=10, json={
            "session_id": "sess_bouncer", "function": "send_email", "parameters": GUIDE_EMAIL,
            "callback_url": relay.url})
        assert created.status_code == 201, created.text
        assert created.json()["status"] == "PENDING"
        sent = created.json()["tool_call_id"]
        started = time.monotonic()
        prepared = requests.post(f"{url}/voice-tools/confirm/{sent}?wait=15", headers=AUTH, timeout=30)
        assert prepared.status_code == 200, prepared.text
        assert prepared.json()["status"] == "PREPARED", (prepared.json(), worker.log()[-3000:])
        done = requests.post(f"{url}/voice-tools/resume/{sent}?wait=15", headers=AUTH, timeout=30,
                             json={"action": "proceed"})
        assert done.status_code == 200, done.text
        assert done.json()["status"] == "COMPLETED", (done.json(), worker.log()[-3000:])
        assert done.json()["voice_response"] == "Email sent to test@example.com."
        assert time.monotonic() - started < 25  # woken by NOTIFY: each wait would run its 15 s without it
        relay.wait_for(sent, "completed")
        assert [e for _, e in relay.events_at(sent)] == ["progress", "checkpoint", "progress", "completed"]

        # a cancel of a call waiting for its confirmation
        other = requests.post(f"{url}/voice-tools/pending", headers=AUTH, timeout=10, json={
            "session_id": "sess_bouncer", "function": "send_email", "parameters": GUIDE_EMAIL,
            "callback_url": relay.url}).json()["tool_call_id"]
        cancelled = requests.delete(f"{url}/voice-tools/cancel/{other}", headers=AUTH, timeout=10)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED", cancelled.text
        relay.wait_for(other, "cancelled")

        # the event stream saw every event of the session, in order, each once
        got = [stream.next_event() for _ in range(5)]
        assert [(e["tool_call_id"], e["event"]) for _, e in got] == [
            (sent, "progress"), (sent, "checkpoint"), (sent, "progress"), (sent, "completed"),
            (other, "cancelled")]
        assert len({event_id for event_id, _ in got}) == 5

        # where the connections go (the stream still open): the API's and the worker's queries to the
        # bouncer; the direct URL used by one connection only, the API's listener, which ran LISTEN
        api = peers(web_processes(url))
        work = peers([p.pid for p in process_family(worker.pid)])
        assert any(bouncer_port in ports for ports in api.values()), api
        assert any(bouncer_port in ports for ports in work.values()), work
        direct_ones = [(name, query) for _, name, query in backends(direct) if name == "voice-tools-listen"]
        assert len(direct_ones) == 1, direct_ones
        assert direct_ones[0][1].startswith("LISTEN") or direct_ones[0][1] == "SELECT 1", direct_ones
        servers = {row["remote_pid"] for row in admin(bouncer_port, user, "SHOW SERVERS")}
        assert servers and servers <= {pid for pid, _, _ in backends(direct)}, servers
        stream.close()

        # the bouncer carried the system's transactions, in transaction mode
        [pool] = [p for p in admin(bouncer_port, user, "SHOW POOLS") if p["database"] == dsn["dbname"]]
        assert pool["pool_mode"] == "transaction", pool
        [stats] = [s for s in admin(bouncer_port, user, "SHOW STATS") if s["database"] == dsn["dbname"]]
        assert stats["total_xact_count"] >= 20, stats
    assert "ERROR" not in worker.log(), worker.log()[-3000:]
