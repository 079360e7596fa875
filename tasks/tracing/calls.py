"""A call's trace context, kept with the call (``tool_calls.trace_context``, migration 0018): the
``traceparent`` of the span that recorded it, read again by a later request about the call."""
from __future__ import annotations

from sqlalchemy import select

from models import db
from models.calls import ToolCall


def kept_context(tool_call_id: str) -> str | None:
    """The ``traceparent`` kept with the call, or None (no such call, or recorded with tracing off).
    Read with the instrumentations suppressed: the read is not a span of a trace of its own."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation(), db.session() as s:
        return s.scalar(select(ToolCall.trace_context).where(ToolCall.tool_call_id == tool_call_id))
