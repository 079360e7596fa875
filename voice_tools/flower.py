"""``voice-tools flower``: Celery's Flower on the tasks app (``celery -A tasks flower``), ending on SIGTERM.

Flower answers SIGTERM by leaving its event loop, and then Python waits, before it ends,
for every thread of Flower's executor; a thread inspecting the workers while the broker
is gone is stuck in kombu's reconnect loop, so Flower lived on until honcho's SIGKILL
5 s later. Here, once Flower's command has returned, the exit handlers run (Flower's
own: it saves its state when ``--persistent``) and the process ends without waiting
for those threads. Every argument is Flower's (``--address``, ``--port`` ...).

Flower is never served without a password: its users come from ``FLOWER_BASIC_AUTH``
(``user:password``, comma-separated for more; Flower reads the variable itself), so no
password is on a command line where ``ps`` shows it to every local user; without it (nor
``--basic-auth`` or ``--auth``) the command refuses to start. Flower's own ``/metrics`` is
served behind the same password (Flower serves it to anyone).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys

EXIT_NO_AUTH = 2


def _has_auth(args: list[str]) -> bool:
    given = {arg.split("=", 1)[0] for arg in args}
    return bool(os.environ.get("FLOWER_BASIC_AUTH", "").strip() or os.environ.get("FLOWER_AUTH", "").strip()
                or given & {"--basic-auth", "--basic_auth", "--auth"})


def metrics_behind_auth() -> None:
    """Serve Flower's ``/metrics`` to its users only (as its API and pages are): a 401 without the password."""
    import tornado.web
    from flower import urls
    from flower.views import monitor

    if getattr(monitor.Metrics, "_voice_tools_authenticated", False):
        return

    class Metrics(monitor.Metrics):
        _voice_tools_authenticated = True

        @tornado.web.authenticated
        async def get(self) -> None:
            await super().get()

    for index, handler in enumerate(urls.handlers):
        if isinstance(handler, tuple) and handler[1] is monitor.Metrics:
            urls.handlers[index] = (handler[0], Metrics, *handler[2:])
        elif getattr(handler, "handler_class", None) is monitor.Metrics:
            handler.handler_class = Metrics


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[2:] if argv is None else argv)
    if not _has_auth(given):
        print("voice-tools flower: set FLOWER_BASIC_AUTH=user:password (Flower is not served without a password)",
              file=sys.stderr, flush=True)
        return EXIT_NO_AUTH
    from celery.bin.celery import celery

    metrics_behind_auth()
    args = ["-A", "tasks", "flower", *given]
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
