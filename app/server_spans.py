"""The server span of each HTTP request: the Flask API's (:func:`register`, from the app factory)
and the MCP face's (:class:`Middleware`, an ASGI middleware).

Its parent is the relay's W3C ``traceparent`` (and ``tracestate``) when it sends one. A request
about a call (its id in the path: confirm, resume, cancel, modify, status) continues the trace
kept with the call instead (``models.trace_context``) when the request's own trace is another or
none: a call recorded without a ``traceparent`` still has one trace, joined by every later request
about it, on any connection or host; the request's own trace, if it sent one, is a link of the
span. A tool call of the MCP face names its call in its arguments: :func:`joined` opens a span in
the call's trace around the operation.

The span's ids go on the request's log lines (``trace_id``, ``span_id``). Nothing is imported
or done with tracing off.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import voice_tools_tracing as tracing
from models import logs

QUIET_PATHS = ("/healthz", "/readyz", "/metrics")  # probes and scrapes: no trace of their own


def _parent(headers: Any, tool_call_id: str | None) -> tuple[Any, list[Any]]:
    """The parent context of a request's span and its links: the relay's ``traceparent``, or the call's trace."""
    from opentelemetry import propagate, trace

    sent = propagate.extract(headers)
    kept = _kept_parent(tool_call_id, trace.get_current_span(sent).get_span_context()) if tool_call_id else None
    return kept or (sent, [])


def register(app: Any) -> None:
    """The Flask app's server spans (after ``app.request_log``, whose context they add to)."""
    if not started("api"):
        return
    from flask import g, request
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    tracer = tracing.tracer()

    @app.before_request
    def _start_span() -> None:
        if request.path in QUIET_PATHS:
            return
        call_id = (request.view_args or {}).get("tool_call_id")
        parent, links = _parent(request.headers, call_id if isinstance(call_id, str) else None)
        route = request.url_rule.rule if request.url_rule is not None else request.path
        span = tracer.start_span(f"{request.method} {route}", context=parent, kind=SpanKind.SERVER, links=links,
                                 attributes={"http.request.method": request.method, "http.route": route,
                                             "url.path": request.path})
        if isinstance(call_id, str):
            span.set_attribute("voice_tools.tool_call_id", call_id)
        g.trace_span = span
        g.trace_token = context.attach(trace.set_span_in_context(span, parent))
        logs.add(**tracing.current_ids())

    @app.after_request
    def _answered(response: Any) -> Any:
        span = g.get("trace_span")
        if span is not None:
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                span.set_status(Status(StatusCode.ERROR))
        return response

    @app.teardown_request
    def _end_span(exc: BaseException | None) -> None:
        span, token = g.pop("trace_span", None), g.pop("trace_token", None)
        if span is not None:
            if exc is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()
        if token is not None:
            context.detach(token)


class Middleware:
    """The MCP face's server span per HTTP request (ASGI), its parent the relay's ``traceparent``."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        parent = propagate.extract(headers)
        span = tracing.tracer().start_span(f"{scope['method']} {scope['path']}", context=parent, kind=SpanKind.SERVER,
                                           attributes={"http.request.method": scope["method"],
                                                       "url.path": scope["path"]})
        token = context.attach(trace.set_span_in_context(span, parent))

        async def answered(message: Any) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        try:
            await self.app(scope, receive, answered)
        finally:
            span.end()
            context.detach(token)


def started(role: str) -> bool:
    """Start tracing in this process if it is asked for (``role``: what the process is); True if it runs."""
    if not tracing.enabled():
        return False
    from tasks.worker import run_spans  # the SDK, then the spans of the publishes this process sends

    return run_spans.start(role)


@contextmanager
def joined(tool_call_id: Any, operation: str) -> Iterator[None]:
    """Around an MCP tool call about ``tool_call_id``: a span in the call's kept trace (a link to the
    request's own), when that trace is another than the request's; else nothing."""
    if not tracing.active() or not isinstance(tool_call_id, str):
        yield
        return
    from opentelemetry import trace

    kept = _kept_parent(tool_call_id, trace.get_current_span().get_span_context())
    if kept is None:
        yield
        return
    parent, links = kept
    with tracing.tracer().start_as_current_span(operation, context=parent, links=links,
                                                attributes={"voice_tools.tool_call_id": tool_call_id}):
        with logs.bound(**tracing.current_ids()):
            yield


def _kept_parent(tool_call_id: str, request: Any) -> tuple[Any, list[Any]] | None:
    """The context kept with the call, and a link to ``request`` (the request's own span context, when
    valid), unless the call kept none or ``request`` is already in the call's trace."""
    from opentelemetry import propagate, trace

    from models.trace_context import kept_context

    kept = kept_context(tool_call_id)
    if not kept:
        return None
    kept_ctx = propagate.extract({"traceparent": kept})
    kept_span = trace.get_current_span(kept_ctx).get_span_context()
    if not kept_span.is_valid or (request.is_valid and request.trace_id == kept_span.trace_id):
        return None
    return kept_ctx, ([trace.Link(request, {"voice_tools.link": "request"})] if request.is_valid else [])
