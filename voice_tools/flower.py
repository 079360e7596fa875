"""``voice-tools flower``: Celery's Flower on the tasks app's queues (``celery -A tasks.flower_app flower``), ending on SIGTERM.

The same Flower is served from a thread of ``voice-tools run``'s own process when its Procfile has no
``flower`` line (``Procfile.local``): :func:`serve_in_thread`.

Its app (``tasks/flower_app.py``) has the tasks app's name, settings and queues but no task: Flower
never runs one, and importing every task module cost it about 30 MB.

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
served behind the same password (Flower serves it to anyone). Flower knows each worker from its
first event (:func:`workers_from_their_events`).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import types
from functools import partial
from typing import Any

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


# What a worker must have answered for Flower's workers page and /api/workers to show it.
KNOWN_BY = ("stats", "active_queues")
# How long a worker may take to answer the inspection its first event starts (it answers within
# milliseconds when idle; one just started, on a busy machine, took more than Flower's 1 s)
LEARN_TIMEOUT_S = 5.0

log = logging.getLogger("voice_tools.flower")


def workers_from_their_events() -> None:
    """Flower learns of each worker from its first event, and inspects it then.

    Flower inspects every worker once when it starts, and again only when asked
    (``/api/workers?refresh=1``): a worker that came up after Flower (``voice-tools run`` starts
    them together, and a worker takes longer) stayed missing from its workers page and
    ``/api/workers``, and that first inspection, answered by no worker, logged four "Inspect method …
    failed" warnings. Here Flower starts without it, and inspects a worker (the methods of Flower's
    own inspection of every worker, addressed to that one, which answers as soon as it can) when one
    of its events (``worker-online``, or a heartbeat, every 2 s) comes from a worker it does not
    know yet; one that did not answer is asked again at its next heartbeat, which is why a miss is
    logged at debug level only. ``?refresh=1`` is Flower's own, unchanged."""
    from flower import app as flower_app

    if getattr(flower_app.Flower, "_voice_tools_learns_workers", False):
        return

    class Flower(flower_app.Flower):
        _voice_tools_learns_workers = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._learning: set[str] = set()
            receive = self.events.on_event

            def on_event(event: dict[str, Any]) -> None:  # in Flower's events thread
                receive(event)
                if event.get("type") in ("worker-online", "worker-heartbeat") and event.get("hostname"):
                    self.io_loop.add_callback(self._learn_worker, event["hostname"], event["type"] == "worker-online")

            self.events.on_event = on_event

        def start(self) -> None:
            self.events.start()
            self.started = True
            self.io_loop.start()  # no blind inspection: each worker is inspected when its first event comes

        async def _learn_worker(self, hostname: str, came_online: bool) -> None:
            known = self.inspector.workers.get(hostname) or {}
            if hostname in self._learning or (not came_online and all(m in known for m in KNOWN_BY)):
                return
            self._learning.add(hostname)
            try:
                await self.io_loop.run_in_executor(None, self._inspect_one, hostname)
            finally:
                self._learning.discard(hostname)

        def _inspect_one(self, hostname: str) -> None:
            inspect = self.capp.control.inspect(timeout=max(self.inspector.timeout, LEARN_TIMEOUT_S),
                                                destination=[hostname])
            for method in self.inspector.methods_to_inspect(None):
                try:
                    answer = getattr(inspect, method)()
                except Exception as exc:  # the broker: Flower's own inspections say so
                    log.debug("inspecting %s (%s) on its first event failed: %s", hostname, method, exc)
                    return
                if not answer or "error" in answer:
                    log.debug("%s did not answer %s yet; asked again at its next heartbeat", hostname, method)
                    return
                for worker, response in answer.items():
                    if response is not None:
                        self.io_loop.add_callback(partial(self.inspector._on_update, worker, method, response))

    flower_app.Flower = Flower
    from flower import command

    command.Flower = Flower


def without_the_amqp_repl() -> None:
    """Celery's CLI imports ``click_repl`` (and through it prompt_toolkit: 6.5 MB PSS in Flower's process) only to
    give ``celery amqp`` its ``repl`` subcommand, which Flower's process never runs: here that subcommand
    is not registered, and none of them is imported. Call it before ``celery.bin`` is imported."""
    if "click_repl" in sys.modules:
        return
    stand_in = types.ModuleType("click_repl", "not imported by voice-tools flower: no `celery amqp repl` here")
    stand_in.register_repl = lambda group, name="repl": None  # type: ignore[attr-defined]
    sys.modules["click_repl"] = stand_in


STOP_WAIT_S = 5.0


def serve_in_thread(address: str, port: int, log_handler: logging.Handler | None = None) -> Any:
    """Flower at ``address:port`` from a daemon thread of this process (tornado's loop of its own); the Flower app
    once it listens. ``voice-tools run`` serves Flower so when its Procfile has no ``flower`` line
    (``Procfile.local``): no Flower process, and the libraries it shares with the run's process (redis,
    psutil, logging) loaded once.

    The same Flower as this command's: the light app (``tasks/flower_app.py``), its users from
    ``FLOWER_BASIC_AUTH`` (SystemExit without a password), ``/metrics`` behind it, each worker
    learnt from its first event, every ``FLOWER_*`` variable of this process Flower reads but
    ``FLOWER_UNAUTHENTICATED_API``. Its series stay its own: ``PROMETHEUS_MULTIPROC_DIR`` is taken out of
    this process's environment (call it before anything imports ``prometheus_client``). Flower's and
    tornado's log lines go to ``log_handler`` when given."""
    if not _has_auth([]):
        raise SystemExit("voice-tools: set FLOWER_BASIC_AUTH=user:password (Flower is not served without a password)")
    os.environ.pop("FLOWER_UNAUTHENTICATED_API", None)
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    import asyncio
    import threading

    metrics_behind_auth()
    workers_from_their_events()
    from flower import command
    from flower.urls import settings
    from tornado.options import options

    if log_handler is not None:
        for name in ("flower", "tornado"):
            logger = logging.getLogger(name)
            logger.addHandler(log_handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
    command.apply_env_options()
    options.address, options.port = address, port
    command.extract_settings()
    command.setup_logging()
    from tasks.flower_app import app

    ready, served = threading.Event(), {}

    def serve() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        try:
            flower_app = command.Flower(capp=app, options=options, **settings)
            flower_app.start_http_server()
        except BaseException as exc:  # noqa: BLE001 - said to the caller
            served["error"] = exc
            ready.set()
            return
        served["app"] = flower_app
        ready.set()
        logging.getLogger("flower.command").info("Visit me at http://%s:%s", address, port)
        flower_app.start()

    threading.Thread(target=serve, name="voice-tools-flower", daemon=True).start()
    ready.wait()
    if "error" in served:
        raise served["error"]
    return served["app"]


def stop_thread(flower_app: Any, wait_s: float = STOP_WAIT_S) -> bool:
    """Stop a Flower of :func:`serve_in_thread`: its events thread, its loop, then wait (up to ``wait_s``) for
    the inspections its executor still runs, while the broker is still there. False when one still runs
    (stuck in kombu's reconnect loop to a broker that is gone): Python would wait for it at exit, so the
    caller should end with ``os._exit``, as :func:`main` does."""
    import time

    flower_app.io_loop.add_callback(flower_app.stop)
    deadline = time.monotonic() + wait_s
    threads = list(getattr(flower_app.executor, "_threads", ()))
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[2:] if argv is None else argv)
    if not _has_auth(given):
        print("voice-tools flower: set FLOWER_BASIC_AUTH=user:password (Flower is not served without a password)",
              file=sys.stderr, flush=True)
        return EXIT_NO_AUTH
    without_the_amqp_repl()
    from celery.bin.celery import celery

    metrics_behind_auth()
    workers_from_their_events()
    args = ["-A", "tasks.flower_app", "flower", *given]
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
