"""A real ``celery -A tasks worker`` in a subprocess, for the tests (and the bench).

The worker runs from the repository root with this process's environment (so the
same ``DATABASE_URL``, broker and ``VOICE_TOOLS_*`` the tests use), in its own
process group so that the whole worker (main process and pool children) can be
killed at once, and always is at the end (:meth:`WorkerProcess.stop`). Its log goes
to a file the test can read.

:func:`queues_taken_from_others` makes a subprocess worker the only consumer of a
queue: any other worker on the broker (the in-process ``worker`` fixture of
``conftest.py``, which consumes every queue) is told to stop consuming it with
Celery's own remote control (``cancel_consumer``) and to resume afterwards.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil

from support.procs import kill_group, process_family

ROOT = Path(__file__).resolve().parent.parent


class WorkerProcess:
    def __init__(self, app: Any, queues: list[str], *, pool: str = "prefork", concurrency: int = 2,
                 log_dir: Path, name: str | None = None, env: dict[str, str] | None = None,
                 include: list[str] | None = None, loglevel: str = "INFO", options: list[str] | None = None):
        self.app = app
        self.name = f"{name or 'w'}-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"
        self.log_path = Path(log_dir) / f"{self.name.split('@')[0]}.log"
        self.stderr_path = self.log_path.with_suffix(".stderr")
        self.argv = [
            sys.executable, "-m", "celery", "-A", "tasks", "worker",
            "--pool", pool, "--concurrency", str(concurrency), "-Q", ",".join(queues),
            "-n", self.name, "--loglevel", loglevel, "--logfile", str(self.log_path),
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]
        for module in include or ():
            self.argv += ["--include", module]
        self.argv += options or []  # more of the worker command's options
        self.env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen | None = None

    # -- life --------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> "WorkerProcess":
        with open(self.stderr_path, "wb") as stderr:  # a file: a pipe nobody reads could fill and block it
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, start_new_session=True,
                                         stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}: "
                                   f"{self.stderr_path.read_text(errors='replace')[-2000:]}\n{self.log()[-2000:]}")
            if self.app.control.ping(destination=[self.name], timeout=0.5):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.log()[-2000:]}")

    def __enter__(self) -> "WorkerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def children(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.pid).children()]
        except psutil.Error:
            return []

    def kill_child(self, pid: int) -> None:
        """SIGKILL one pool child (it must be ours)."""
        assert pid in self.children(), f"{pid} is not a child of worker {self.pid}"
        os.kill(pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the whole worker: main process and every child (its process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        family = self._family()
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        psutil.wait_procs(family, timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM to the main process alone: a pool child's own SIGTERM would end its task), then
        SIGKILL the group if it lingers. Safe twice."""
        if self.proc is None:
            return
        family = self._family()
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        kill_group(self.proc, family)

    def _family(self) -> list[psutil.Process]:
        return process_family(self.pid)

    # -- what it is doing ----------------------------------------------------------------

    def active(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """The tasks this worker is running now (``celery inspect active``)."""
        replies = self.app.control.inspect(destination=[self.name], timeout=timeout).active() or {}
        return replies.get(self.name) or []

    def wait_active(self, task_name: str, args: list[Any], *, not_pid: int | None = None,
                    timeout: float = 60.0) -> dict[str, Any]:
        """Block until this worker runs ``task_name`` with ``args`` as its first arguments (a link's are
        the call's id, then its chain's), in a child other than ``not_pid``."""
        deadline = time.monotonic() + timeout
        while True:
            for request in self.active():
                if request["name"] == task_name and list(request["args"])[:len(args)] == list(args) \
                        and request.get("worker_pid") and request["worker_pid"] != not_pid:
                    return request
            if time.monotonic() > deadline:
                raise AssertionError(f"{task_name}{tuple(args)} not running on {self.name} within {timeout}s:"
                                     f"\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@contextmanager
def queues_taken_from_others(app: Any, queues: list[str], within_s: float = 30.0) -> Iterator[None]:
    """Stop every worker now on the broker from consuming ``queues``; undo afterwards.

    A worker slow to answer the first ``inspect`` (a loaded machine) would keep consuming, so
    where the broker counts consumers (RabbitMQ) this asks again until it counts none on
    ``queues``; Redis counts none, and the first round is the only one, after which the workers'
    pending pops are waited out (:func:`_past_pending_pops`).
    """
    taken: list[tuple[str, str]] = []
    deadline = time.monotonic() + within_s
    try:
        while True:
            replies = app.control.inspect(timeout=2.0).active_queues() or {}
            for worker, consumed in replies.items():
                for queue in queues:
                    if (worker, queue) not in taken and any(q["name"] == queue for q in consumed):
                        app.control.cancel_consumer(queue, destination=[worker], reply=True, timeout=5.0)
                        taken.append((worker, queue))
            still = {queue: n for queue in queues if (n := _consumers(app, queue))}
            if not still:
                _past_pending_pops(app, bool(taken))
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"queues still consumed after {within_s:.0f} s: {still}")
        yield
    finally:
        for worker, queue in taken:
            app.control.add_consumer(queue, destination=[worker], reply=True, timeout=5.0)


def _past_pending_pops(app: Any, cancelled: bool) -> None:
    """On Redis a worker's ``BRPOP`` issued before its consumer was cancelled still names the queue until it
    returns (kombu's ``brpop_timeout``, 1 s): a message published meanwhile is popped and put back later
    ("Requeuing undeliverable message"), neither queued nor unacknowledged in between. Wait it out."""
    if not cancelled:
        return
    with app.connection_for_write() as conn:
        if conn.transport.driver_type == "amqp":
            return
        time.sleep(float(getattr(conn.default_channel, "brpop_timeout", 1.0)) + 0.5)


def _consumers(app: Any, queue: str) -> int:
    """How many consumers the broker counts on ``queue`` (0 where it counts none: Redis)."""
    with app.connection_for_write() as conn:
        if conn.transport.driver_type != "amqp":
            return 0
        try:
            return conn.default_channel.queue_declare(queue=queue, passive=True).consumer_count
        except conn.channel_errors:  # no such queue (yet): no consumer on it
            return 0
