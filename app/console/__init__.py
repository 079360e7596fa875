"""The operator console at ``/console``: a face of its own beside REST and MCP, for people.

Its pages, script, style and icon (``app/console/static/``, ``templates/``, carried in the wheel)
are served without a token; its data (``/console/api/…``) needs one, as every REST request
does, and is fenced the same way: a caller sees its own calls, an admin everyone's. Its views
call the room's operations (``tasks/calls/browse.py``; the actions are REST's own endpoints,
and a redelivery the operators' ``admin.redeliver``). Every answer carries a strict
Content-Security-Policy (no inline script or style, nothing but this origin) and
``X-Frame-Options: DENY``.
"""
from __future__ import annotations

from flask import Flask

from app.console import data, headers, live, pages


BLUEPRINTS = (pages.bp, data.bp, live.bp)
for _blueprint in BLUEPRINTS:
    headers.guard(_blueprint)


def register(app: Flask) -> None:
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
