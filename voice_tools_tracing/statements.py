"""The span of a statement run by ``models/compiled.py`` (the hot paths' statements: a link's gate, claim
and record, a call's transitions, an event's delivery).

Such a statement is prepared on the server once per connection and then run as ``EXECUTE
voice_tools_<hash>(...)``, which is all psycopg2's instrumentation could name and show: its span is made
here instead, on the driver's plain cursor, named by what the statement does (``UPDATE tool_calls``,
``INSERT callback_deliveries``: the operation and its table) with its SQL in ``db.statement``, the
attributes psycopg2's instrumentation gives every other statement (``db.system``, ``db.name``,
``db.user``, ``net.peer.name``, ``net.peer.port``), an error's status and exception. One span per run,
its first run on a connection (the ``PREPARE``) included. Only inside a recorded span (a statement
outside a trace makes none, as the instrumentation's own sampler has it), and not at all when
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` leaves psycopg2's statements out.
"""
from __future__ import annotations

from typing import Any

import voice_tools_tracing as tracing

_ATTRIBUTES = "voice_tools_trace_attributes"  # in a pooled connection's info: its spans' attributes


def begun(name: str, sql: str, dbapi: Any, info: dict[str, Any]) -> Any:
    """The statement's span, started (None outside a recorded span)."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    if not trace.get_current_span().is_recording():
        return None
    attributes = info.get(_ATTRIBUTES)
    if attributes is None:
        attributes = info[_ATTRIBUTES] = _connection_attributes(dbapi)
    return tracing.tracer().start_span(name, kind=SpanKind.CLIENT, attributes={**attributes, "db.statement": sql})


def ended(span: Any, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:300]))
    span.end()


def _connection_attributes(dbapi: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"db.system": "postgresql"}
    connected = getattr(dbapi, "info", None)  # psycopg2's ConnectionInfo
    for key, field in (("db.name", "dbname"), ("db.user", "user"), ("net.peer.name", "host")):
        value = getattr(connected, field, None)
        if value:
            found[key] = str(value)
    port = getattr(connected, "port", None)
    if port:
        found["net.peer.port"] = int(port)
    return found
