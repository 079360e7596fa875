"""The floor of the API benchmark: a bare Flask app doing the one statement each endpoint needs.

Served by gunicorn from the Procfile's ``web`` line with ``bench.bare:create_app()`` in
place of ``app:create_app()`` (same worker class, workers, threads and config), against
the same database, with SQLAlchemy Core on the same engine; no auth, no validation, no
schema, no log context:

- ``POST /voice-tools/pending``: an ``INSERT ... RETURNING`` of a ``tool_calls`` row;
- ``POST /voice-tools/confirm/<id>``: the confirm's own statement (``lifecycle.confirm``:
  the compare-and-set PENDING → EXECUTING) and one message published (a bare link); with
  a JSON body ``{"links": n, "callback_url": url, "until": event}``, a bare chain of ``n``
  links posting their events to ``url`` (``bench/noop.py``; ``"record": true``: links doing the
  work every link must do), for the chain benchmark;
- ``GET /voice-tools/status/<id>``: a ``SELECT`` of the row;
- ``GET /voice-tools/context/<session>``: the context's own statement
  (``queries.session_calls``), its rows as JSON.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

from flask import Flask, Response, request
from sqlalchemy import insert, select

CONTEXT_LIMIT = 10  # the API's default
CALLER = "bench"  # the name of the bench's API token: the API scopes its statements to it


def _json(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload, default=str), status=status, mimetype="application/json")


def create_app() -> Flask:
    from bench import noop
    from models import db, lifecycle, queries
    from models.calls import ToolCall

    calls = ToolCall.__table__
    engine = db.engine()
    bare = Flask("bare")

    @bare.post("/voice-tools/pending")
    def pending() -> Any:
        body = request.get_json()
        with engine.begin() as conn:
            row = conn.execute(insert(calls).values(
                tool_call_id="tc_" + secrets.token_hex(6), session_id=body["session_id"],
                function_name=body["function"], action_level="write", parameters=body["parameters"],
                caller=CALLER,
            ).returning(calls.c.tool_call_id, calls.c.status, calls.c.parameters)).one()
        return _json(dict(row._mapping), 201)

    @bare.post("/voice-tools/confirm/<tool_call_id>")
    def confirm(tool_call_id: str) -> Any:
        with engine.begin() as conn:
            row = lifecycle.confirm(conn, tool_call_id)
        chain = request.get_json(silent=True) or {}
        if chain.get("links"):
            noop.chain_of(tool_call_id, chain["links"], chain.get("callback_url"), chain.get("until", "completed"),
                          record=bool(chain.get("record"))).apply_async()
        else:
            noop.noop.si(tool_call_id).apply_async()
        return _json({"tool_call_id": row.tool_call_id, "status": row.status}, 202)

    @bare.get("/voice-tools/status/<tool_call_id>")
    def status(tool_call_id: str) -> Any:
        with engine.begin() as conn:
            row = conn.execute(select(calls).where(calls.c.tool_call_id == tool_call_id)).one()
        return _json(dict(row._mapping))

    @bare.get("/voice-tools/context/<session_id>")
    def context(session_id: str) -> Any:
        with engine.begin() as conn:
            open_calls, recent = queries.session_calls(conn, session_id, CONTEXT_LIMIT, caller=CALLER)
        return _json({"session_id": session_id, "pending": [dict(r._mapping) for r in open_calls],
                      "recent": [dict(r._mapping) for r in recent]})

    @bare.get("/healthz")
    def healthz() -> Any:
        return _json({"status": "ok"})

    return bare
