"""The REST face's hooks for each caller's fair share (``app/shares.py``, which has no Flask: the MCP face
uses it too): after ``app.auth``'s, every request with a caller counts against its rate; one that asks to
wait, on a view that waits, holds a slot until it is answered (or, its caller's share full, is refused 429
before it does anything). ``/healthz`` names no caller and is never limited."""
from __future__ import annotations

from flask import Flask, g, request

from app import handover, shares
from tasks.calls import schemas


def register(app: Flask) -> None:
    def waits(endpoint: str | None) -> bool:
        view = app.view_functions.get(endpoint) if endpoint else None
        return getattr(view, "openapi", {}).get("query") is schemas.WaitQuery

    @app.before_request
    def _count_share() -> None:
        who = g.get("who")
        if who is None:
            return
        shares.check_rate(who.name)
        if shares.asks_to_wait(request.args) and waits(request.endpoint):
            # a wait the server gives the socket of is answered by the stream loop (app/wait_answer.py)
            held = handover.socket_of(request.environ, ("POST",)) is None
            g.share_slot = shares.wait_slot(who.name, request.args.get("wait"), holds_thread=held)

    @app.teardown_request
    def _release_share(_exc: BaseException | None) -> None:
        slot = g.pop("share_slot", None)
        if slot is not None:
            slot.release()
