"""A Procfile's processes run from the calling process by honcho's ``Manager``: a thread per process, no fork.

``honcho start`` is a Python process of its own that forks one more (``multiprocessing``) for each
line, only to wait for that line's shell and pass its output on: five Python processes, about
23 MB PSS, for a local run's four lines. Here the same ``Manager`` (its prefixed, timed lines,
its ``system`` lines, stopping every line on SIGINT or SIGTERM, and the others when one ends,
SIGKILL to every process group after 5 s) runs in the calling process, and each line's shell is
waited for and read by a thread. What ``honcho start -f PROCFILE -e ENV_FILE`` gives each process is
kept: the caller's environment, then the env file's, ``HONCHO_PROCESS_NAME``, and ``PORT`` counting
up by 100 from ``PORT`` (the env file's, else the environment's, else 5000) line by line.

One thing differs, the stop. honcho sends SIGTERM to a line's whole process group; a Celery
worker's pool children, which take SIGTERM's default action, then die in the middle of their links
(``WorkerLostError``) instead of finishing them in the worker's warm shutdown. Here a line that is
one command runs with ``exec`` (its shell becomes the program: ``env … celery …`` is celery) and the
SIGTERM goes to that process alone, as Kubernetes, podman and systemd's ``KillMode=mixed`` send it; a
line of several commands keeps its shell and gets honcho's SIGTERM to its group.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import shlex
import signal
import threading
import time
from pathlib import Path

from honcho.compat import ProcessManager
from honcho.environ import expand_processes, parse, parse_procfile
from honcho.manager import Manager
from honcho.printer import Message

DEFAULT_PORT = 5000  # honcho's

# what makes a line more than one command (its shell must stay): an operator, or one of these first
_OPERATORS = {";", "&", "&&", "|", "||", "(", ")", ";;"}
_COMPOUND = {"if", "for", "while", "until", "case", "{", "!", "time", "function", "select"}


def exec_form(cmd: str) -> str | None:
    """``cmd`` run with ``exec`` (as it is if it starts with ``exec``), or None when it is not one simple
    command its shell can replace itself with: more than one line, an operator, a compound keyword first, a
    variable assignment before the program (``A=1 prog``; ``env A=1 prog`` is one command)."""
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: the shell will say so
        return None
    if not words or "\n" in cmd.strip() or words[0] in _COMPOUND or "=" in words[0]:
        return None
    if any(word in _OPERATORS for word in words):
        return None
    return cmd if words[0] == "exec" else f"exec {cmd}"


class _LeaderOnly(ProcessManager):
    """honcho's signals, but SIGTERM to a line's own process where its shell exec'd it."""

    def __init__(self, manager: "ThreadedManager") -> None:
        self.manager = manager

    def terminate(self, pid: int) -> None:
        if not self.manager.exec_pid(pid):
            super().terminate(pid)
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


class ThreadedManager(Manager):
    """honcho's ``Manager``, each process waited for by a thread of this process instead of a forked one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events.close()  # the multiprocessing queue a forked process would need
        self.events = queue.Queue()
        self._procmgr = _LeaderOnly(self)
        self.exec_lines: set[str] = set()  # the lines run with ``exec``: a line's pid is its program's

    def add_process(self, name, cmd, quiet=False, env=None, cwd=None):
        exec_cmd = exec_form(cmd)
        if exec_cmd is not None:
            self.exec_lines.add(name)
        return super().add_process(name, exec_cmd or cmd, quiet=quiet, env=env, cwd=cwd)

    def exec_pid(self, pid: int) -> bool:
        """``pid`` is the process of a line run with ``exec`` (its own program, not a shell)."""
        children = (getattr(self._processes[name]["obj"], "_child", None) for name in self.exec_lines)
        return any(child is not None and child.pid == pid for child in children)

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
    it could), with the loop's own signals: SIGTERM to each started line (its own process where it was
    exec'd, else its group), SIGKILL to each process group left after ``wait_s``."""
    children = [entry["obj"]._child for entry in manager._processes.values()
                if getattr(entry["obj"], "_child", None) is not None]
    for send in (manager._procmgr.terminate, manager._procmgr.kill):  # each ignores a process gone meanwhile
        running = [child for child in children if child.poll() is None]
        for child in running:
            send(child.pid)
        deadline = time.monotonic() + wait_s
        while any(child.poll() is None for child in running) and time.monotonic() < deadline:
            time.sleep(0.1)
