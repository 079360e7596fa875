"""A call's trace context, kept with the call (``tool_calls.trace_context``, migration 0018): the
``traceparent`` of the span that recorded it, read again by a later request about the call, unless
this process recorded the call lately (``voice_tools_tracing.remembered``: no statement)."""
from __future__ import annotations

from sqlalchemy import bindparam, select

import voice_tools_tracing as tracing
from models import db
from models.calls import ToolCall
from models.compiled import Compiled

# one statement in autocommit, prepared on the server (models/compiled.py): a request about a call
# reads it before its own work, on the request's path
_KEPT = Compiled(select(ToolCall.trace_context).where(ToolCall.tool_call_id == bindparam("p_id")))


def kept_context(tool_call_id: str) -> str | None:
    """The ``traceparent`` kept with the call, or None (no such call, or recorded with tracing off).
    Read with the instrumentations suppressed: the read is not a span of a trace of its own."""
    here = tracing.remembered(tool_call_id)
    if here is not None:
        return here
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation(), db.statement() as conn:
        row = _KEPT.one_or_none(conn, {"p_id": tool_call_id})
    return row[0] if row is not None else None
