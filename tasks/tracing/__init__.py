"""One trace per call (OpenTelemetry): the relay's request, every link, every callback, in one tree.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (and
``OTEL_SDK_DISABLED`` is not ``true``): then nothing of OpenTelemetry is imported and every
function here answers at once (no span, no thread). On, each process starts the SDK once, as it
starts (``tasks.tracing.sdk.start``: the API's app factory, a worker's main process, beat, the
MCP face), and its hooks make the spans:

- ``tasks.tracing.web``: a server span per HTTP request (Flask, and the MCP face's ASGI app), whose
  parent is the relay's ``traceparent``, or the trace kept with the call the request is about;
- ``tasks.tracing.links``: a span per link (Celery's instrumentation, named after the task, with
  the call, tool, step, attempt and outcome), and the attempt a killed pool child lost;
- ``tasks.tracing.callbacks``: the span of a callback's POST, whose context it sends
  (``traceparent``, ``tracestate``).

This module is ground floor and imports nothing of ours; the hooks import OpenTelemetry only
when they are called with tracing on.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACER = "voice_tools"

_started = False  # set by tasks.tracing.sdk.start in the process that started the SDK


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Are traces asked for (an OTLP endpoint is set, the SDK is not disabled)?"""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def active() -> bool:
    """Has this process started the SDK (so spans are made here)?"""
    return _started


def current_ids() -> dict[str, str]:
    """``trace_id`` and ``span_id`` (hex) of the span under way; {} with tracing off or outside a span."""
    if not _started:
        return {}
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


def traceparent() -> str | None:
    """The W3C ``traceparent`` of the span under way (what a call recorded now keeps); None with tracing off."""
    ids = current_ids()
    if not ids:
        return None
    from opentelemetry import trace

    flags = int(trace.get_current_span().get_span_context().trace_flags)
    return f"00-{ids['trace_id']}-{ids['span_id']}-{flags:02x}"


def tracer() -> Any:
    from opentelemetry import trace

    return trace.get_tracer(TRACER)
