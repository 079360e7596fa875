"""The worker's and beat's side of a trace: tracing started as they start (before a pool forks), its
last spans exported as a pool child exits and at a warm stop, and the attempt a killed pool child lost.

The span of each run is ``tasks.worker.run_spans``'s.

A pool child killed in the middle of a link never ends its span: the worker's main process,
which requeues the message (``reject_on_worker_lost``), ends a span for that attempt in its place
(from the time the child took the message to the loss, status ERROR). A whole worker killed loses
its attempt's span with it: the run that follows is marked ``voice_tools.redelivered``.
"""
from __future__ import annotations

import logging
from typing import Any

from celery import signals

import voice_tools_tracing as tracing

log = logging.getLogger(__name__)


def install(app: Any) -> None:
    """Start tracing in a worker's main process (before its pool forks) and in beat, when asked for."""
    if not tracing.enabled():
        return
    signals.worker_init.connect(_worker_started, weak=False)
    signals.beat_init.connect(_beat_started, weak=False)
    # a pool child's last spans as it exits (os._exit: no atexit), the main process's at its warm stop
    signals.worker_process_shutdown.connect(_stopping, weak=False)
    signals.worker_shutdown.connect(_stopping, weak=False)


def _worker_started(sender: Any = None, **_: Any) -> None:
    from tasks.worker import run_spans

    if run_spans.start("worker") and sender is not None:
        lost = _lost_attempt_request()
        for task in sender.app.tasks.values():  # the main process makes each task's Request class at consumer start
            if getattr(task, "acks_late", False):
                task.Request = lost


def _beat_started(**_: Any) -> None:
    from tasks.worker import run_spans

    run_spans.start("beat")


def _stopping(**_: Any) -> None:
    from voice_tools_tracing import sdk

    sdk.stop()


def _lost_attempt_request() -> type:
    from billiard.exceptions import WorkerLostError
    from celery.worker.request import Request

    class LostAttemptTraced(Request):
        """Celery's request; when its pool child was lost, the attempt's span is ended here."""

        def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)
            if isinstance(exc, (WorkerLostError, SystemExit, KeyboardInterrupt)) \
                    and not (self._already_cancelled or self._already_revoked):
                try:
                    _span_of_lost_attempt(self, exc)
                except Exception:  # tracing must never change what the worker does
                    log.exception("could not record the lost attempt of %s", self.id)
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    return LostAttemptTraced


def _span_of_lost_attempt(request: Any, exc: BaseException) -> None:
    import time

    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    from tasks.worker.run_spans import PREFIX, attributes

    if not request.time_start:
        return
    parent = propagate.extract(request.request_dict or {})
    delivery = request.delivery_info or {}
    found = attributes(request.task, request.args, request.request_dict.get("retries") or 0,
                       bool(delivery.get("redelivered")))
    found[PREFIX + "outcome"] = "worker_lost"
    span = tracing.tracer().start_span(request.name, context=parent, kind=SpanKind.CONSUMER, attributes=found,
                                       start_time=int(request.time_start * 1e9))
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:300]))
    span.end(end_time=time.time_ns())
