"""The trace context that crosses a process's edge: W3C ``traceparent`` and ``tracestate``, nothing else.

:class:`TraceContextOnly` is the one propagator of a tracing process (``voice_tools_tracing.sdk.start`` makes it
the global one, whatever ``OTEL_PROPAGATORS`` says): every read of a request's headers (the API's and the
MCP face's server spans, the MCP SDK's ``_meta``), of a task message's and every write (a publish, a
callback's POST) goes through it.

- ``baggage`` is neither read nor sent: a relay's baggage goes to no task and no callback URL.
- ``tracestate`` is bounded to the W3C limits as it is read and as it is sent: at most 32 members and
  512 bytes. A member that is not a W3C ``key=value`` is dropped, then members over 128 bytes, then members
  from the end until it fits (the W3C's own order of truncation).
- Nothing read is logged: the text a client sent never reaches a log line through OpenTelemetry's
  propagators. Their loggers (:data:`QUIETED`) are bounded by :class:`Refused`: a record of theirs
  says only that a trace header was refused, at most once a minute per logger and process, with the
  count of the ones not written.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Iterable

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_MEMBERS = 32
MAX_BYTES = 512
MAX_MEMBER_BYTES = 128  # the first to go when a tracestate is over MAX_BYTES
READ_AT_MOST = 8192  # of a tracestate's text sent: what is past it is not looked at
# the W3C key (simple, or tenant@system) and value (printable ASCII but ',' and '=', no trailing space)
_KEY = re.compile(r"[a-z][_0-9a-z\-*/]{0,255}(?:@[a-z][_0-9a-z\-*/]{0,13})?"
                     r"|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}")
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")

# OpenTelemetry's loggers that write what a carrier held (a baggage header, a tracestate member)
QUIETED = ("opentelemetry.baggage", "opentelemetry.baggage.propagation",
           "opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span",
           "opentelemetry.propagators.textmap", "opentelemetry.propagate")
REFUSED_EVERY_S = 60.0


def bounded(members: Iterable[str]) -> list[tuple[str, str]]:
    """The ``(key, value)`` pairs of a tracestate's members that are valid and fit the W3C limits,
    in order (a key seen twice: its first)."""
    pairs: list[tuple[str, str]] = []
    keys: set[str] = set()
    for member in members:
        member = member.strip(" \t")
        key, sep, value = member.partition("=")
        if not sep or key in keys or not _KEY.fullmatch(key) or not _VALUE.fullmatch(value):
            continue
        keys.add(key)
        pairs.append((key, value))
    if len(",".join(f"{k}={v}" for k, v in pairs)) > MAX_BYTES:
        pairs = [(k, v) for k, v in pairs if len(k) + 1 + len(v) <= MAX_MEMBER_BYTES]
    kept: list[tuple[str, str]] = []
    size = -1
    for key, value in pairs[:MAX_MEMBERS]:
        size += 1 + len(key) + 1 + len(value)
        if size > MAX_BYTES:
            break
        kept.append((key, value))
    return kept


def tracestate_of(values: Iterable[str] | None) -> Any:
    """A bounded ``TraceState`` from a carrier's ``tracestate`` field(s) (repeated fields are one list),
    or None when none was sent or none of it is kept."""
    if not values:
        return None
    from opentelemetry.trace.span import TraceState

    text, room = [], READ_AT_MOST
    for value in values:
        if room <= 0:
            break
        text.append(value[:room])
        room -= len(value) + 1
    kept = bounded(",".join(text).split(","))
    return TraceState(kept) if kept else None


class TraceContextOnly:
    """A ``TextMapPropagator``: OpenTelemetry's W3C trace context one, with ``tracestate`` bounded
    (:func:`bounded`) and nothing logged; ``baggage`` is not a field of it."""

    def __init__(self) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._w3c = TraceContextTextMapPropagator()

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        from opentelemetry import trace
        from opentelemetry.propagators import textmap

        getter = getter or textmap.default_getter
        parent = getter.get(carrier, TRACEPARENT)
        if not parent:
            return context if context is not None else _empty()
        # traceparent alone through the W3C propagator (its regex logs nothing), the tracestate bounded here
        extracted = self._w3c.extract({TRACEPARENT: parent[0][:128]}, context=context)
        found = trace.get_current_span(extracted).get_span_context()
        if not found.is_valid:
            return extracted
        state = tracestate_of(getter.get(carrier, TRACESTATE))
        if state is None:
            return extracted
        with_state = trace.SpanContext(trace_id=found.trace_id, span_id=found.span_id, is_remote=True,
                                       trace_flags=found.trace_flags, trace_state=state)
        return trace.set_span_in_context(trace.NonRecordingSpan(with_state), context)

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        from opentelemetry import trace
        from opentelemetry.propagators import textmap

        setter = setter or textmap.default_setter
        found = trace.get_current_span(context).get_span_context()
        if not found.is_valid:
            return
        setter.set(carrier, TRACEPARENT, f"00-{found.trace_id:032x}-{found.span_id:016x}-{int(found.trace_flags):02x}")
        if found.trace_state:
            kept = bounded(f"{k}={v}" for k, v in found.trace_state.items())
            if kept:
                setter.set(carrier, TRACESTATE, ",".join(f"{k}={v}" for k, v in kept))

    @property
    def fields(self) -> set[str]:
        return {TRACEPARENT, TRACESTATE}


def _empty() -> Any:
    from opentelemetry.context import Context

    return Context()


class Refused(logging.Filter):
    """On a logger of :data:`QUIETED`: its record says only that a trace header was refused, at most once
    every :data:`REFUSED_EVERY_S` (the others are counted and dropped); its text and arguments are gone."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._next = 0.0
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._dropped += 1
                return False
            dropped, self._dropped, self._next = self._dropped, 0, now + REFUSED_EVERY_S
        record.msg = "a trace header was refused (%d more since the last such line)" if dropped \
            else "a trace header was refused"
        record.args = (dropped,) if dropped else None
        record.exc_info = record.exc_text = record.stack_info = None
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install() -> None:
    """This process's propagator is :class:`TraceContextOnly` and OpenTelemetry's propagators' loggers say
    only :class:`Refused`'s line (once per process)."""
    from opentelemetry import propagate

    propagate.set_global_textmap(TraceContextOnly())  # type: ignore[arg-type]
    for name in QUIETED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, Refused) for f in logger.filters):
            logger.addFilter(Refused())
