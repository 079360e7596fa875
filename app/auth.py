"""The API's token check: every request but ``/healthz`` and the console's pages and files names its
caller (``tasks.calls.callers``).

A Flask ``before_request`` hook: the caller of the request's Bearer token is kept in
``g.who`` (a :class:`Caller`, with ``admin``) and its name in ``g.caller``; a request without
a known token is answered 401 by the JSON error handlers (``app.errors``). What a token and a
caller are is the room's (``tasks.calls.callers``).
"""
from __future__ import annotations

from flask import Flask, g, request

from app.console.pages import is_page
from tasks.calls.callers import identify

OPEN_PATHS = frozenset({"/healthz"})


def register(app: Flask) -> None:
    @app.before_request
    def _check_token() -> None:
        if request.path in OPEN_PATHS or is_page(request.path):  # the console's data needs a token; its pages not
            return
        g.who = identify(request.headers.get("Authorization", ""))
        g.caller = g.who.name
