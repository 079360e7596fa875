"""The console's data, each view one line over the room's operations (``tasks/calls/browse.py``), with
the caller ``app/auth.py`` found for the request's token, asking through the console (its actions'
history entries say ``via: console``). The actions on a call (cancel, proceed) are REST's own
operations; a redelivery is the operators' ``admin.redeliver``, for one event; an action on many calls is
``tasks/calls/bulk.py``'s, a batch a request."""
from __future__ import annotations

from flask import Blueprint, g

from app import inputs
from app.console.pages import DATA_PREFIX
from tasks.calls import browse, bulk
from tasks.calls.callers import Caller, through

bp = Blueprint("console_data", __name__, url_prefix=DATA_PREFIX.rstrip("/"))


def _who() -> Caller:
    return through(g.who, "console")


@bp.get("/me")
def whoami():
    return browse.whoami(g.who)


@bp.get("/calls")
def calls():
    return browse.page(inputs.query(), g.who)


@bp.get("/counts")
def counts():
    return browse.counts(inputs.query(), g.who)


@bp.get("/calls/<tool_call_id>")
def call(tool_call_id: str):
    return browse.call(tool_call_id, g.who)


@bp.post("/calls/<tool_call_id>/cancel")
def cancel(tool_call_id: str):
    return browse.cancel(tool_call_id, inputs.body(), _who())


@bp.post("/calls/<tool_call_id>/proceed")
def proceed(tool_call_id: str):
    return browse.proceed(tool_call_id, _who())


@bp.get("/bulk/<action>")
def bulk_chosen(action: str):
    return bulk.chosen(action, inputs.query(), g.who)


@bp.post("/bulk/<action>")
def bulk_act(action: str):
    return bulk.act(action, inputs.body(), _who())


@bp.post("/calls/<tool_call_id>/run-again")
def run_again(tool_call_id: str):
    return browse.run_again(tool_call_id, inputs.body(), _who())


@bp.post("/calls/<tool_call_id>/events/<event_id>/redeliver")
def redeliver(tool_call_id: str, event_id: str):
    return browse.redeliver(tool_call_id, event_id, _who())


@bp.get("/tools")
def tool_figures():
    return browse.tool_figures(g.who)
