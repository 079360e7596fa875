"""The console's pages and files, served without a token: one HTML page per view (the list of calls,
one call, a session, the tools), its script, style and icon. What a page shows is read by its
script with the token the person signed in with (``app/console/data.py``)."""
from __future__ import annotations

from flask import Blueprint, render_template

from tasks.calls import schemas

PREFIX = "/console"
DATA_PREFIX = f"{PREFIX}/api/"

bp = Blueprint("console_pages", __name__, static_folder="static", static_url_path=f"{PREFIX}/static",
               template_folder="templates")


FAVICON = "/favicon.ico"  # what a browser asks of any page without an icon of its own (the API's JSON too)


def is_page(path: str) -> bool:
    """Is ``path`` one of the console's pages or files (served without a token), not its data?"""
    return path == FAVICON or ((path == PREFIX or path.startswith(f"{PREFIX}/")) and not path.startswith(DATA_PREFIX))


def _page(view: str, ident: str = ""):
    return render_template("console.html", view=view, ident=ident)


@bp.get(FAVICON)
def favicon():
    return bp.send_static_file("icon.svg")


@bp.get(PREFIX)
def calls():
    return _page("calls")


@bp.get(f"{PREFIX}/calls/<tool_call_id>")
def call(tool_call_id: str):
    return _page("call", schemas.load(schemas.ToolCallPath, {"tool_call_id": tool_call_id})["tool_call_id"])


@bp.get(f"{PREFIX}/sessions/<session_id>")
def session(session_id: str):
    return _page("session", schemas.load(schemas.SessionPath, {"session_id": session_id})["session_id"])


@bp.get(f"{PREFIX}/tools")
def tool_figures():
    return _page("tools")
