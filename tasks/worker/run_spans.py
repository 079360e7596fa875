"""The span of each task run and of each publish, made here with Celery's signals only.

A publish (``before_task_publish`` .. ``after_task_publish``, in the API or in a worker) is a producer
span ``apply_async/<task>``, from the message's making to its sending, whose ``traceparent`` goes in the
message's headers. A run (``task_prerun`` .. ``task_postrun``) is a consumer span named after its task
(``tools.send_email.PREPARING``), child of the span that sent it, with the call, tool, step, attempt
and outcome. A chain's next link is sent while the link's span is current, so the links of a chain
are one line of parents and children, and the time between a link's publish and its run is the
queue's wait. It needs nothing of the one base Task (``tasks/base.py``): only the signals and the
message's headers.

This is what ``opentelemetry-instrumentation-celery`` does, less what a link does not need: its copy of
Celery's request fields into ``celery.*`` attributes (a dozen on each run and publish, each one
validated, kept and exported), its per-task bookkeeping and its task-duration metric.

The publish's own Redis commands (the ``LPUSH`` of the message) are not spans of their own: the
``apply_async/<task>`` span is that publish, from the same call to its return, and the broker's
connection is never instrumented (``voice_tools_tracing.redis_client``).
"""
from __future__ import annotations

import threading
from typing import Any

from celery import signals

import voice_tools_tracing as tracing
from models import logs, release

PREFIX = "voice_tools."

_publishing = threading.local()  # .under_way: the publish span under way on this thread
_running: dict[str, tuple[Any, Any]] = {}  # task id -> the run's span and its context token


class _Headers:
    """The W3C propagator's getter on a task's request: the message's headers are its attributes."""

    @staticmethod
    def get(carrier: Any, key: str) -> list[str] | None:
        value = getattr(carrier, key, None)
        return [value] if isinstance(value, str) else None

    @staticmethod
    def keys(_carrier: Any) -> list[str]:
        return []


def start(role: str) -> bool:
    """Start tracing in this process if it is asked for (``role``: what the process is): the SDK, with this
    release's version, then the spans of the runs and publishes (every process publishes or runs tasks: the
    API, the MCP face, a worker, beat). True if it runs."""
    from voice_tools_tracing import sdk

    if not sdk.start(role, release.VERSION):
        return False
    instrument()  # the runs and publishes: voice-tools' own spans, the trace's spine
    return True


def instrument() -> None:
    """The spans of runs and publishes in this process (:func:`start`; a receiver connected twice is one)."""
    signals.task_prerun.connect(_begun, weak=False)
    signals.task_postrun.connect(_ended, weak=False)
    signals.task_failure.connect(_failed, weak=False)
    signals.before_task_publish.connect(_publish_begun, weak=False)
    signals.after_task_publish.connect(_published, weak=False)


def attributes(task: Any, args: Any, retries: int, redelivered: bool) -> dict[str, Any]:
    found: dict[str, Any] = {PREFIX + "task": task.name, PREFIX + "attempt": int(retries or 0) + 1 + int(redelivered)}
    if redelivered:
        found[PREFIX + "redelivered"] = True
    step = getattr(task, "step", None)  # a chain's link
    if step is not None:
        found[PREFIX + "tool"] = task.tool.name
        found[PREFIX + "step"] = step.name
        if args and isinstance(args[0], str):
            found[PREFIX + "tool_call_id"] = args[0]
    return found


def _begun(sender: Any = None, task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    from opentelemetry import context, propagate, trace
    from opentelemetry.trace import SpanKind

    task = task or sender
    if task is None or task_id is None:
        return
    request = task.request
    parent = propagate.extract(request, getter=_Headers)
    redelivered = bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))
    span = tracing.tracer().start_span(task.name, context=parent, kind=SpanKind.CONSUMER,
                                       attributes=attributes(task, args, request.retries, redelivered))
    _running[task_id] = (span, context.attach(trace.set_span_in_context(span, parent)))
    logs.add(**tracing.current_ids())  # undone with the task's log context (tasks/worker/log_context.py)


def _ended(task_id: str | None = None, state: str | None = None, **_: Any) -> None:
    from opentelemetry import context

    span, token = _running.pop(task_id, (None, None)) if task_id else (None, None)
    if span is None:
        return
    if state:
        span.set_attribute(PREFIX + "outcome", state.lower())
    span.end()
    context.detach(token)


def _failed(task_id: str | None = None, exception: BaseException | None = None, sender: Any = None, **_: Any) -> None:
    from opentelemetry.trace import Status, StatusCode

    span, _token = _running.get(task_id, (None, None)) if task_id else (None, None)
    if span is None or exception is None:
        return
    exc = getattr(exception, "exc", exception)  # billiard's ExceptionWithTraceback
    if isinstance(exc, tuple(getattr(sender, "throws", ()) or ())):
        return  # an expected error (the task's ``throws``): no error status
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:300]))


def _publish_begun(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """The publish's span, its context in the message's headers. It is not made current: nothing the send
    does is a span (the broker's connection is not instrumented, ``voice_tools_tracing.redis_client``)."""
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind

    name = sender if isinstance(sender, str) else getattr(sender, "name", "unknown")
    span = tracing.tracer().start_span(f"apply_async/{name}", kind=SpanKind.PRODUCER)
    if headers is not None:
        propagate.inject(headers, context=trace.set_span_in_context(span))
    _publishing.under_way = span


def _published(**_: Any) -> None:
    """Sent: the span ends (a publish that raised leaves its span unended, and unexported)."""
    span, _publishing.under_way = getattr(_publishing, "under_way", None), None
    if span is not None:
        span.end()
