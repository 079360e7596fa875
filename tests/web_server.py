"""The Procfile's ``web`` line (real gunicorn) started for a test, against this run's servers."""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests

from support.procs import ROOT, free_port, stop_process


def web_command(procfile: str = "Procfile") -> str:
    for line in (ROOT / procfile).read_text().splitlines():
        if line.startswith("web:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{procfile} has no web line")


@contextmanager
def gunicorn_web(procfile: str = "Procfile", log_to: Path | None = None, **extra: str) -> Iterator[str]:
    """Run the web line of ``procfile`` as honcho does (``sh -c``), this run's DATABASE_URL and REDIS_URL
    in its environment; yield its base URL once ``/healthz`` answers. Its output goes to ``log_to`` if given."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="voice-tools-web-") as scratch:
        metrics_dir = Path(scratch) / "prometheus"
        metrics_dir.mkdir()
        env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), "WEB_CONCURRENCY": "1",
               "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONPATH": str(ROOT),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **extra}
        log_to = log_to or Path(scratch) / "web.log"
        log = open(log_to, "wb")
        proc = subprocess.Popen(["sh", "-c", f"exec {web_command(procfile)}"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log_to.read_text(errors="replace")
                try:
                    if requests.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                assert time.monotonic() < deadline, log_to.read_text(errors="replace")
                time.sleep(0.2)
            yield url
        finally:
            stop_process(proc)
            log.close()


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` answers read off the socket (each with a Content-Length)."""
    raw, answers = b"", []
    while len(answers) < count:
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(65536)
            assert chunk, (answers, raw)
            raw += chunk
        head, _, raw = raw.partition(b"\r\n\r\n")
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(raw) < length:
            raw += sock.recv(65536)
        answers.append((int(head.split(b" ", 2)[1]), raw[:length]))
        raw = raw[length:]
    return answers


def served_after_idle(sock: socket.socket, request: bytes, idle_s: float = 7) -> list[int]:
    """``request`` sent on ``sock``, then again after ``idle_s`` seconds of quiet: the two answers' statuses.
    The connection must still be open after the quiet (a relay's pause while the caller speaks)."""
    sock.sendall(request)
    statuses = [status for status, _ in read_answers(sock, 1)]
    time.sleep(idle_s)
    readable, _, _ = select.select([sock], [], [], 0)
    assert not readable, sock.recv(1, socket.MSG_PEEK)  # b"": the server closed it while it was idle
    sock.sendall(request)
    return statuses + [status for status, _ in read_answers(sock, 1)]
