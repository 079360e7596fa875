"""A Procfile's processes run from the calling process by honcho's ``Manager``: a thread per process, no fork.

``honcho start`` is a Python process of its own that forks one more (``multiprocessing``) for each
line, only to wait for that line's shell and pass its output on: five Python processes, about
23 MB PSS, for a local run's four lines. Here the same ``Manager`` (its prefixed, timed lines,
its ``system`` lines, stopping every process group on SIGINT or SIGTERM, and the others when one
ends, SIGKILL after 5 s) runs in the calling process, and each line's shell is waited for and
read by a thread. What ``honcho start -f PROCFILE -e ENV_FILE`` gives each process is kept: the
caller's environment, then the env file's, ``HONCHO_PROCESS_NAME``, and ``PORT`` counting up by
100 from ``PORT`` (the env file's, else the environment's, else 5000) line by line.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import signal
import threading
import time
from pathlib import Path

from honcho.environ import expand_processes, parse, parse_procfile
from honcho.manager import Manager
from honcho.printer import Message

DEFAULT_PORT = 5000  # honcho's


class ThreadedManager(Manager):
    """honcho's ``Manager``, each process waited for by a thread of this process instead of a forked one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events.close()  # the multiprocessing queue a forked process would need
        self.events = queue.Queue()

    def _start(self) -> None:
        for name, entry in self._processes.items():
            # signals stay with the main thread (the Manager's handlers); the process's own session gets none
            entry["process"] = threading.Thread(name=f"procfile-{name}", target=entry["obj"].run,
                                                args=(self.events, False), daemon=True)
            entry["process"].start()


def line_names(procfile: Path) -> set[str]:
    """The names of a Procfile's lines (``web``, ``worker`` ...)."""
    return set(parse_procfile(procfile.read_text()).processes)


class LinesOf(logging.Handler):
    """Log records printed among a manager's lines as a process of ``name`` would print them (``flower | …``),
    for what runs in the calling process beside the Procfile's lines. Lines that come once the manager's loop
    has ended are not printed."""

    def __init__(self, manager: Manager, name: str) -> None:
        super().__init__()
        self.manager, self.process_name = manager, name
        manager._printer.width = max(manager._printer.width, len(name))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.manager.events.put(Message(type="line", data=self.format(record) + "\n",
                                            time=datetime.datetime.now(), name=self.process_name, colour=None))
        except Exception:  # noqa: BLE001 - logging's own way
            self.handleError(record)


def manager_for(procfile: Path, env: dict[str, str], env_file: Path | None = None) -> ThreadedManager:
    """A manager with every line of ``procfile`` added, each with the environment ``honcho start`` would give it."""
    file_env = parse(env_file.read_text()) if env_file is not None and env_file.is_file() else {}
    port = int(file_env.get("PORT") or env.get("PORT") or DEFAULT_PORT)
    manager = ThreadedManager()
    for process in expand_processes(parse_procfile(procfile.read_text()).processes, env=file_env, port=port):
        manager.add_process(process.name, process.cmd, quiet=process.quiet, env={**env, **process.env})
    return manager


def stop(manager: Manager, wait_s: float = 5.0) -> None:
    """Stop what a manager's loop left running (it leaves nothing when it ends by itself, but an error in
    it could): SIGTERM each started process group, SIGKILL what is left after ``wait_s``."""
    children = [entry["obj"]._child for entry in manager._processes.values()
                if getattr(entry["obj"], "_child", None) is not None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [child for child in children if child.poll() is None]
        for child in running:
            try:
                os.killpg(child.pid, sig)
            except OSError:  # gone meanwhile
                pass
        deadline = time.monotonic() + wait_s
        while any(child.poll() is None for child in running) and time.monotonic() < deadline:
            time.sleep(0.1)
