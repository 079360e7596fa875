"""The Procfile's processes for the benchmark, and their bare twins.

Each process is its Procfile line run by ``bash -c`` as honcho runs it, in the
environment ``voice-tools run`` gives them (``launcher.run_environment``), in its own
process group, its output in a file of the data folder:

- ``web``: the API under gunicorn, as in production (its workers and threads);
- ``bare_web``: the same line serving ``bench.bare:create_app()`` (the floor);
- ``writes``, ``reads``, ``callbacks``: the worker lines, as written;
- ``bare``: the ``reads`` line running the plain Celery app of ``bench.noop`` in place of the
  product's app (same pool, same concurrency), for the bare chains.

A stack may start some of them only (``names``), and may keep its broker on a Redis database of
its own (``broker_db``: the broker's and the API's shared counts' database), so two stacks can run
side by side on the same servers without taking each other's messages.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import requests

from support.procs import ROOT, free_port, kill_group, process_family
from support.system import procfile_lines

WORKERS = ("writes", "reads", "callbacks", "bare")
PRODUCT = ("web", "writes", "reads", "callbacks")  # the product's processes (no floor)


def on_database(url: str, db: int) -> tuple[str, str]:
    """A Redis URL moved to database ``db``: as Celery's broker URL (kombu's ``virtual_host``), and as
    ``REDIS_URL`` (redis-py's, read by the API's shared counts)."""
    if url.startswith("redis+socket://"):
        path = url[len("redis+socket://"):].split("?", 1)[0]
        return f"redis+socket://{path}?virtual_host={db}", f"unix://{path}?db={db}"
    if url.startswith(("redis://", "rediss://")):
        base = url.split("?", 1)[0]
        scheme, rest = base.split("://", 1)
        moved = f"{scheme}://{rest.split('/', 1)[0]}/{db}"
        return moved, moved
    raise ValueError(f"not a Redis broker: {url.split('://', 1)[0]}://...")


def commands() -> dict[str, str]:
    lines = procfile_lines()
    web, reads = lines["web"], lines["reads"]
    bare_web = web.replace("'app:create_app()'", "'bench.bare:create_app()'")
    bare = reads.replace("celery -A tasks worker --hostname reads@%h --group reads",
                         "celery -A bench.noop worker --hostname bare@%h --queues bench.noop")
    assert bare_web != web and bare.count("bench.noop") == 2, "the Procfile's web or reads line changed"
    return {"web": web, "bare_web": bare_web, "writes": lines["writes"], "reads": reads,
            "callbacks": lines["callbacks"], "bare": bare}


class Stack:
    """Start with :meth:`start` (waits until every web answers and every worker pings), stop with :meth:`stop`."""

    def __init__(self, data_dir: Path, names: tuple[str, ...] | None = None, broker_db: int | None = None):
        from voice_tools.launcher import run_environment

        self.dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.env, _filled = run_environment(data_dir / "data")
        self.env["PYTHONPATH"] = str(ROOT)  # this checkout's code (and bench/) in every process
        self.broker_db = broker_db
        if broker_db is not None:
            self.env["CELERY_BROKER_URL"], self.env["REDIS_URL"] = on_database(
                self.env.get("CELERY_BROKER_URL") or self.env["REDIS_URL"], broker_db)
        self.ports = {"web": free_port(), "bare_web": free_port()}
        self.urls = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self.commands = {name: line for name, line in commands().items() if names is None or name in names}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, timeout: float = 120.0) -> "Stack":
        for name, command in self.commands.items():
            env = dict(self.env, PORT=str(self.ports.get(name, 0)))
            with open(self.dir / f"{name}.log", "ab") as log:
                self.procs[name] = subprocess.Popen(
                    ["bash", "-c", f"exec {command}"], cwd=ROOT, env=env, start_new_session=True,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Each web answers ``/healthz``, then every worker answers a ping."""
        from tasks import app

        deadline = time.monotonic() + timeout
        for name in ("web", "bare_web"):
            if name in self.commands:
                self._until(lambda: self._answers(self.urls[name]), name, deadline)
        silent = set(WORKERS) & set(self.commands)

        def pinged() -> bool:
            if self.broker_db is None:
                replies = app.control.ping(timeout=1.0) or []
                silent.difference_update(host.split("@")[0] for reply in replies for host in reply)
            else:  # a broker database of its own: the bench's app pings on its own; the worker's word
                silent.difference_update([name for name in silent if f'"{name}@' in self.log(name)
                                          and ' ready."' in self.log(name)])
            return not silent

        self._until(pinged, "the workers", deadline)

    def _until(self, check: Any, what: str, deadline: float) -> None:
        while not check():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready in time\n" + "\n".join(
                    f"--- {name}\n{self.log(name)[-1500:]}" for name in self.procs))
            time.sleep(0.3)

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            return requests.get(f"{url}/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def holders(self, name: str) -> dict[int, set[int]]:
        """The gunicorn ``name``'s workers (``web`` or ``bare_web``): pid -> the client ports of the
        connections it holds open (a keep-alive connection stays with the worker that accepted it)."""
        port = self.ports[name]
        return {worker.pid: {c.raddr.port for c in worker.net_connections("tcp")
                             if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port and c.raddr}
                for worker in psutil.Process(self.procs[name].pid).children()}

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            kill_group(proc, process_family(proc.pid))
        self.procs.clear()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
