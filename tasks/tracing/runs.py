"""The span of each task run: Celery's instrumentation, each run's span named after its task
(``tools.send_email.PREPARING``) and given the call, tool, step, attempt and outcome.

Celery's own instrumentation (``opentelemetry-instrumentation-celery``) carries the context in each
message's headers (``before_task_publish``: an ``apply_async/<task>`` producer span, its
``traceparent`` in the headers) and runs each task under a consumer span whose parent is the span
that sent it (``task_prerun`` .. ``task_postrun``). A chain's next link is sent by Celery while the
link's span is current, so the links of a chain are one line of parents and children, and the
time between a link's publish and its run is the queue's wait. It needs nothing of the one base
Task (``tasks/base.py``): only Celery's signals and the message's headers.

The publish's own Redis command (the ``LPUSH`` of the message) is not a span of its own: the
``apply_async/<task>`` span is that publish, from the same call to its return, and the Redis
instrumentation is suppressed inside it (its span would repeat it, with the message's body as its
statement, and cost a span on every link's path).
"""
from __future__ import annotations

import threading
from typing import Any

from celery import signals

import tasks.tracing as tracing
from models import logs

PREFIX = "voice_tools."

_publishing = threading.local()  # .suppressed: the suppression entered for the publish under way on this thread


def instrument() -> None:
    """Celery's instrumentation, with the span of each run named and described here (``sdk.start``)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    signals.task_postrun.connect(_ended, weak=False)  # before the instrumentation's own, which ends the span
    signals.after_task_publish.connect(_published, weak=False)  # before its own: contexts detached in order
    CeleryInstrumentor().instrument()
    signals.task_prerun.connect(_begun, weak=False)  # after it: its span is the current one
    signals.before_task_publish.connect(_publish_begun, weak=False)  # after its own, which starts the span


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


def _begun(sender: Any = None, task: Any = None, args: Any = None, **_: Any) -> None:
    from opentelemetry import trace

    task = task or sender
    span = trace.get_current_span()
    if task is None or not span.is_recording():
        return
    request = task.request
    redelivered = bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))
    span.update_name(task.name)
    span.set_attributes(attributes(task, args, request.retries, redelivered))
    logs.add(**tracing.current_ids())  # undone with the task's log context (tasks/worker/log_context.py)


def _publish_begun(**_: Any) -> None:
    """The publish's span is current: no span for the Redis commands that send the message (the
    instrumentations' own ``suppress_instrumentation``, entered here and left at :func:`_published`)."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    suppressed = suppress_instrumentation()
    suppressed.__enter__()
    _publishing.suppressed = suppressed


def _published(**_: Any) -> None:
    """Sent: the Redis instrumentation on again (a publish that raised is undone with its task's or
    request's context, which the Celery instrumentation and ``tasks.tracing.web`` detach)."""
    suppressed, _publishing.suppressed = getattr(_publishing, "suppressed", None), None
    if suppressed is not None:
        suppressed.__exit__(None, None, None)


def _ended(sender: Any = None, state: str | None = None, **_: Any) -> None:
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording() and state:
        span.set_attribute(PREFIX + "outcome", state.lower())


