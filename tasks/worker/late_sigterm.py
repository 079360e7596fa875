"""A worker whose warm shutdown is done ends 0, even when SIGTERM comes again as the process exits.

Some stoppers send SIGTERM more than once: podman 4.3's ``podman stop`` sends it twice (seen 40 ms
to 1.2 s apart), and people send it again. Celery takes each one as the same warm shutdown. But once
the worker has shut down, Python, as it exits, gives each signal its handlers caught back to the
default action, and a SIGTERM landing then kills the process: a worker that finished every link
ends 143 (killed by SIGTERM) instead of 0, which a supervisor or a restart policy reads as a crash.
So once Celery says the worker has shut down (``worker_shutdown``), the worker's process ignores
SIGTERM for the moments it has left; SIGKILL still ends it.

Only the ``celery worker`` command's process, in its main thread: a worker run inside another
program (the tests' in-process worker) leaves that program's signals alone.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

from celery.apps.worker import Worker
from celery.signals import worker_shutdown


def _ignore_late_sigterm(sender: Any = None, **_: Any) -> None:
    if isinstance(sender, Worker) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def install(app: Any) -> None:
    worker_shutdown.connect(_ignore_late_sigterm, weak=False)
