"""``voice-tools flower``: Celery's Flower on the tasks app (``celery -A tasks flower``), ending on SIGTERM.

Flower answers SIGTERM by leaving its event loop, and then Python waits, before it ends,
for every thread of Flower's executor; a thread inspecting the workers while the broker
is gone is stuck in kombu's reconnect loop, so Flower lived on until honcho's SIGKILL
5 s later. Here, once Flower's command has returned, the exit handlers run (Flower's
own: it saves its state when ``--persistent``) and the process ends without waiting
for those threads. Every argument is Flower's (``--address``, ``--port``, ``--basic-auth`` ...).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from celery.bin.celery import celery

    args = ["-A", "tasks", "flower", *(sys.argv[2:] if argv is None else argv)]
    try:
        code = celery.main(args=args, prog_name="celery", auto_envvar_prefix="CELERY")
    except SystemExit as exc:
        code = exc.code
    code = code if isinstance(code, int) else (0 if code is None else 1)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
