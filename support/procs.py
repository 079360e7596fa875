"""Process helpers for the tests that start the system or its servers as child processes."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SERVER_VARS = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")


def bare_env(**extra: str) -> dict[str, str]:
    """This run's environment without the server variables (conftest set them), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in SERVER_VARS}
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def running(data_dir: Path) -> list[psutil.Process]:
    """Live processes started for ``data_dir``.

    They inherit VOICE_TOOLS_DATA_DIR, except that redis-server rewrites its process
    title over its environment: it (and postgres) is known by its working folder,
    which is in the data dir. Zombies have ended and are not counted.
    """
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("VOICE_TOOLS_DATA_DIR") == str(data_dir) or \
                    Path(proc.cwd()).is_relative_to(data_dir):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_none_running(data_dir: Path, timeout: float = 15.0) -> list[psutil.Process]:
    """Wait for every process of ``data_dir`` to end; return those still there."""
    deadline = time.monotonic() + timeout
    left = running(data_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = running(data_dir)
    return left


def wait_listening(port: int, timeout: float = 180.0) -> bool:
    """Wait until something accepts connections on 127.0.0.1:``port``; False if nothing did in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return True
        except OSError:
            time.sleep(0.5)
    return False


def wait_for_log(log: Path, wanted: str | re.Pattern[str], proc: subprocess.Popen, timeout: float = 90.0,
                 every: float = 0.2) -> None:
    """Wait until the log of ``proc`` holds ``wanted`` (a text, or a pattern searched); fail the test, with the
    log's end, if ``proc`` exits first or ``timeout`` runs out. Reads only what was written since the last look."""
    import pytest

    deadline, seen, offset = time.monotonic() + timeout, "", 0
    while True:
        with open(log, "rb") as f:
            f.seek(offset)
            more = f.read()
        offset += len(more)
        seen += more.decode(errors="replace")
        if (wanted.search(seen) if isinstance(wanted, re.Pattern) else wanted in seen):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(every)
    pytest.fail(f"no {getattr(wanted, 'pattern', wanted)!r} in the log of {proc.args[:4]}:\n{seen[-3000:]}")


def running_with(procs: list[psutil.Process], command: str, variable: str) -> list[psutil.Process]:
    """Those of ``procs`` whose command line holds ``command`` and whose environment sets ``variable`` (a
    Procfile line's ``env VAR=… prog``: ``env`` has replaced itself with the program, which has it)."""
    found = []
    for proc in procs:
        try:
            if command in " ".join(proc.cmdline()) and variable in proc.environ():
                found.append(proc)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            out.append(str(proc.pid))
    return out


# -- processes sharing one data dir's embedded servers ---------------------------------------

HOLD = """
    import json, signal
    from voice_tools import servers
    urls = servers.ensure_servers()
    print(json.dumps(urls), flush=True)
    signal.pause()
"""


def hold_servers(data_dir: Path) -> tuple[subprocess.Popen, dict]:
    """A process that starts the servers as ``voice-tools run`` does and keeps them until SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD)], cwd=ROOT,
        env=bare_env(VOICE_TOOLS_DATA_DIR=str(data_dir)), stdout=subprocess.PIPE, text=True,
    )
    return proc, json.loads(proc.stdout.readline())


def voice_tools(data_dir: Path, *args: str, **popen: object) -> subprocess.Popen:
    """This worktree's ``voice-tools`` command (launcher.py), with no server variables set."""
    return subprocess.Popen([sys.executable, "-m", "voice_tools", *args], cwd=ROOT,
                            env=bare_env(VOICE_TOOLS_DATA_DIR=str(data_dir)), text=True, **popen)


def server_answers(urls: dict) -> dict:
    """Which servers answer at ``urls``: the postmaster's start time, Redis's pid, and a value kept in Redis."""
    import psycopg2
    import redis

    conn = psycopg2.connect(urls["DATABASE_URL"], connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_postmaster_start_time()::text")
            started = cur.fetchone()[0]
    finally:
        conn.close()
    client = redis.Redis.from_url(urls["REDIS_URL"].replace("redis+socket://", "unix://"), socket_timeout=5)
    try:
        return {"postgres": started, "redis": client.info("server")["process_id"], "kept": client.get("kept")}
    finally:
        client.close()


def process_family(pid: int) -> list[psutil.Process]:
    """Every descendant of ``pid`` now (none if it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_group(proc: subprocess.Popen, family: list[psutil.Process], timeout: float = 10.0) -> None:
    """SIGKILL the process group led by ``proc`` (started with ``start_new_session``), reap it, and
    kill any of ``family`` (its descendants, taken before) still alive: one that left the group is
    still ours."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(30)
    _gone, left = psutil.wait_procs(family, timeout=timeout)
    for child in left:
        try:
            child.kill()
        except psutil.Error:
            pass


def stop_process(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)
