"""The log context across Celery (see ``logs``), with Celery's own signals only.

- Publishing (in the API or in a worker), the context bound then goes into the task
  message's headers (``before_task_publish``): the request that started a chain, and
  its call and session, travel with every link, retry and callback it sends.
- Running, a task binds that context plus its own id, name and step for the time it
  runs (``task_prerun`` / ``task_postrun``); a link's ``tool_call_id`` is its first
  argument when no header says it. A task no request started (beat's sweeps) gets its
  chain's first task id as ``request_id``.
- Celery's loggers (worker, beat, the task logger) get our format and context as soon
  as Celery has set them up (``after_setup_logger`` / ``after_setup_task_logger``), in
  the worker's main process and again in each pool child. With JSON logs the worker's
  ASCII banner (many lines of not-JSON) is replaced by one line.
"""
from __future__ import annotations

import logging
import os
import sys
from contextvars import Token
from typing import Any

from celery import signals
from celery.apps import worker as celery_worker
from celery.utils.log import get_multiprocessing_logger

from models import logs

log = logging.getLogger(__name__)

CARRIED = ("request_id", "trace_id", "tool_call_id", "session_id")  # what a message carries; the rest is the task's own

_tokens: dict[str, Token] = {}


@signals.before_task_publish.connect
def _carry(headers: dict[str, Any] | None = None, **_: Any) -> None:
    bound = logs.current()
    carried = {key: bound[key] for key in CARRIED if key in bound}
    if headers is not None and carried:
        headers[logs.HEADER] = carried


def _first_arg(args: Any) -> str | None:
    return args[0] if args and isinstance(args[0], str) else None


@signals.task_prerun.connect
def _bind(task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    request = getattr(task, "request", None)
    carried = getattr(request, logs.HEADER, None) or {}
    step = getattr(getattr(task, "step", None), "name", None)  # a chain link's step
    _tokens[task_id] = logs.bind(
        request_id=carried.get("request_id") or getattr(request, "root_id", None) or task_id,
        trace_id=carried.get("trace_id"),
        tool_call_id=carried.get("tool_call_id") or (_first_arg(args) if step else None),
        session_id=carried.get("session_id"),
        task_id=task_id,
        task=getattr(task, "name", None),
        step=step,
    )


@signals.task_postrun.connect
def _unbind(task_id: str | None = None, **_: Any) -> None:
    token = _tokens.pop(task_id, None)
    if token is not None:
        logs.reset(token)


@signals.after_setup_logger.connect
def _format_celery_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    if logger is not None:
        logs.adopt(logger)
    logs.adopt(get_multiprocessing_logger())


@signals.after_setup_task_logger.connect
def _format_task_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    if logger is not None:
        logs.adopt(logger)


@signals.celeryd_init.connect
def _json_from_the_start(instance: Any = None, **_: Any) -> None:
    """With JSON logs, the worker writes nothing else, from its first line to its last.

    Sent before Celery checks the user it runs as (whose SecurityWarning as root would be
    printed raw) and sets up its logging: the warnings go through logging, to a JSON
    handler on the root logger until Celery replaces it with its own
    (``worker_hijack_root_logger``). The banner is replaced by one line (``_say_started``);
    the few sentences Celery writes from its signal handlers without logging ("worker:
    Warm shutdown") become JSON lines, written as Celery writes them (one ``os.write``,
    no lock taken in a signal handler).
    """
    if instance is None or logs.log_format() != "json":
        return
    instance.quiet = True  # read in Worker.on_start, after this signal
    logging.captureWarnings(True)
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logs.stderr_handler())
    celery_worker.safe_say = _say_json


def _say_json(msg: str, f: Any = sys.__stderr__) -> None:
    try:
        os.write(f.fileno(), (logs.line(logging.INFO, celery_worker.__name__, msg.strip()) + "\n").encode())
    except (OSError, AttributeError, ValueError):
        pass  # as Celery's own: losing a sentence must not stop the shutdown


@signals.celeryd_after_setup.connect
def _say_started(sender: str | None = None, instance: Any = None, **_: Any) -> None:
    if logs.log_format() != "json" or instance is None:
        return
    queues = sorted(q.name for q in instance.app.amqp.queues.consume_from.values())
    log.info("worker %s starting: queues %s, concurrency %s", sender, ",".join(queues), instance.concurrency)
