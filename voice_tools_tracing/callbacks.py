"""The span of a callback's POST (``tasks/delivery/transport.py``): a client span, child of what
sends it (a link, a retry of the callbacks queue, a cancel), whose context goes in the request's
``traceparent`` and ``tracestate`` headers, so the relay's handler continues the call's trace."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import voice_tools_tracing as tracing


@contextmanager
def posting(url: str, headers: dict[str, str]) -> Iterator[Any]:
    """Around one attempt's exchange: the span (None with tracing off), its context added to ``headers``."""
    if not tracing.active():
        yield None
        return
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    event = headers.get("X-Voice-Tools-Event", "event")
    with tracing.tracer().start_as_current_span(
            f"callback {event}", kind=SpanKind.CLIENT,
            attributes={"http.request.method": "POST", "url.full": url.split("?", 1)[0],
                        "voice_tools.event": event,
                        "voice_tools.event_id": headers.get("X-Voice-Tools-Event-Id", "")}) as span:
        propagate.inject(headers)
        yield span


def answered(span: Any, code: int | None, error: str | None) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    if code is not None:
        span.set_attribute("http.response.status_code", code)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error[:300]))
