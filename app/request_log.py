"""Each API request's log context (see ``logs``): its id, and the call and session it is about.

The request id is the caller's ``X-Request-ID`` when it sends a sane one, else the
trace id of a W3C ``traceparent``, else a new one; it is answered back in
``X-Request-ID``. The path's ``tool_call_id`` / ``session_id`` are bound before the
view runs, a body's when the view reads it (``app.inputs.body``), a call's session
when the operation loads the call it acts on (``tasks.calls.operations``), else an answer's
after the view. The
context is left in the WSGI environ for gunicorn's access line, written after the
request is over (``app.gunicorn_conf``).
"""
from __future__ import annotations

from typing import Any

from flask import Flask, Response, g, request

from models import logs

HEADER = "X-Request-ID"
IDS = ("tool_call_id", "session_id")
ENVIRON_KEY = "voice_tools.log"  # gunicorn's access line reads it as the atom ``{voice_tools.log}e``


def bind_ids(data: Any) -> None:
    """Add the ``tool_call_id`` and ``session_id`` a body or an answer names (as strings) to the
    request's context; outside a request, nothing."""
    if "log_token" not in g or not isinstance(data, dict):
        return
    bound = logs.current()
    logs.add(**{key: data.get(key) for key in IDS if key not in bound and isinstance(data.get(key), str)})


def register(app: Flask) -> None:
    @app.before_request
    def _bind_request() -> None:
        traceparent = request.headers.get("traceparent")
        g.request_id = logs.request_id(request.headers.get(HEADER), traceparent)
        g.log_token = logs.bind(request_id=g.request_id, trace_id=logs.trace_id(traceparent))
        bind_ids(request.view_args)

    @app.after_request
    def _answer_request_id(response: Response) -> Response:
        if response.is_json and not all(key in logs.current() for key in IDS):
            bind_ids(response.get_json(silent=True))
        response.headers[HEADER] = g.get("request_id") or logs.request_id()
        request.environ[ENVIRON_KEY] = logs.current()
        return response

    @app.teardown_request
    def _unbind(_exc: BaseException | None) -> None:
        token = g.pop("log_token", None)
        if token is not None:
            logs.reset(token)  # and so everything added since (logs.add)
