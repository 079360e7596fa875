"""The API's endpoints against the bare Flask app doing the same statement (``bench/bare.py``).

Each maker returns :data:`Sides`: for ``"api"`` and for ``"bare"`` (the floor), one timed request of
that side for the request index it is given (``bench.load.pair_of`` asks both in turn). What a
request needs beforehand (a PENDING call to confirm) is made untimed, on each side by its own app.
"""
from __future__ import annotations

from typing import Any

from bench import load
from bench.calls import AUTH, links_to_checkpoint

SESSION = "bench_api"
ENDPOINTS = ("pending", "confirm", "status", "context")

Sides = dict[str, load.Side]


def _pending_body(i: int) -> dict[str, Any]:
    return {"session_id": SESSION, "function": "send_email",
            "parameters": {"to": f"bench{i}@example.com", "subject": "Bench"}}


def pending(api: str, bare: str) -> Sides:
    return {"api": lambda i: load.call("POST", f"{api}/voice-tools/pending", 201, headers=AUTH,
                                       json=_pending_body(i))[0],
            "bare": lambda i: load.call("POST", f"{bare}/voice-tools/pending", 201, json=_pending_body(i))[0]}


def confirm(api: str, bare: str) -> Sides:
    """A send_email call confirmed: its chain runs to the checkpoint on the writes worker (no
    callback URL: its events are recorded, not posted); the floor's confirm sends a bare chain
    of as many links recording theirs (``bench/noop.py``), so that under 16 clients both sides
    carry the same kind of load behind the request."""
    from tasks import tools

    links = links_to_checkpoint(tools.TOOLS["send_email"])

    def side(base: str, headers: dict[str, str], body: Any) -> load.Side:
        def timed(i: int) -> float:
            _s, created = load.call("POST", f"{base}/voice-tools/pending", 201, headers=headers, json=_pending_body(i))
            return load.call("POST", f"{base}/voice-tools/confirm/{created['tool_call_id']}", 202,
                             headers=headers, json=body)[0]
        return timed

    return {"api": side(api, AUTH, None),
            "bare": side(bare, {}, {"links": links, "record": True, "until": "checkpoint"})}


def status(api: str, bare: str, id_for: Any = None) -> Sides:
    """GET status of the call ``id_for(i)``, by default of one call recorded now."""
    if id_for is None:
        recorded = load.call("POST", f"{api}/voice-tools/pending", 201, headers=AUTH,
                             json=_pending_body(0))[1]["tool_call_id"]
        id_for = lambda i: recorded  # noqa: E731
    return _reads(api, bare, lambda i: f"/voice-tools/status/{id_for(i)}")


def context(api: str, bare: str, session_for: Any = None) -> Sides:
    """GET context of the session ``session_for(i)`` (by default the one the pending requests fill)."""
    return _reads(api, bare, lambda i: f"/voice-tools/context/{session_for(i) if session_for else SESSION}")


def _reads(api: str, bare: str, path_for: Any) -> Sides:
    return {"api": lambda i: load.call("GET", f"{api}{path_for(i)}", 200, headers=AUTH)[0],
            "bare": lambda i: load.call("GET", f"{bare}{path_for(i)}", 200)[0]}
