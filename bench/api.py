"""The API's endpoints against the bare Flask app doing the same statement (``bench/bare.py``).

Each maker returns a :data:`bench.load.Pair`: one request to the API and the same one to
the floor, timed, for the request index it is given. What a request needs beforehand (a
PENDING call to confirm) is made untimed, on each side by its own app.
"""
from __future__ import annotations

from typing import Any

from bench import load
from bench.calls import AUTH, links_to_checkpoint

SESSION = "bench_api"
ENDPOINTS = ("pending", "confirm", "status", "context")


def _pending_body(i: int) -> dict[str, Any]:
    return {"session_id": SESSION, "function": "send_email",
            "parameters": {"to": f"bench{i}@example.com", "subject": "Bench"}}


def pending(api: str, bare: str) -> load.Pair:
    def pair(i: int) -> dict[str, float]:
        return {"api": load.call("POST", f"{api}/voice-tools/pending", 201, headers=AUTH, json=_pending_body(i))[0],
                "bare": load.call("POST", f"{bare}/voice-tools/pending", 201, json=_pending_body(i))[0]}
    return pair


def confirm(api: str, bare: str) -> load.Pair:
    """A send_email call confirmed: its chain runs to the checkpoint on the writes worker (no
    callback URL: its events are recorded, not posted); the floor's confirm sends a bare chain
    of as many links recording theirs (``bench/noop.py``), so that under 16 clients both sides
    carry the same kind of load behind the request."""
    from tasks import tools

    links = links_to_checkpoint(tools.TOOLS["send_email"])

    def pair(i: int) -> dict[str, float]:
        timed = {}
        for side, base, headers, body in (("api", api, AUTH, None),
                                          ("bare", bare, {}, {"links": links, "record": True, "until": "checkpoint"})):
            _s, created = load.call("POST", f"{base}/voice-tools/pending", 201, headers=headers, json=_pending_body(i))
            timed[side] = load.call("POST", f"{base}/voice-tools/confirm/{created['tool_call_id']}", 202,
                                    headers=headers, json=body)[0]
        return timed
    return pair


def status(api: str, bare: str, id_for: Any = None) -> load.Pair:
    """GET status of the call ``id_for(i)``, by default of one call recorded now."""
    if id_for is None:
        recorded = load.call("POST", f"{api}/voice-tools/pending", 201, headers=AUTH,
                             json=_pending_body(0))[1]["tool_call_id"]
        id_for = lambda i: recorded  # noqa: E731
    return _reads(api, bare, lambda i: f"/voice-tools/status/{id_for(i)}")


def context(api: str, bare: str, session_for: Any = None) -> load.Pair:
    """GET context of the session ``session_for(i)`` (by default the one the pending requests fill)."""
    return _reads(api, bare, lambda i: f"/voice-tools/context/{session_for(i) if session_for else SESSION}")


def _reads(api: str, bare: str, path_for: Any) -> load.Pair:
    def pair(i: int) -> dict[str, float]:
        path = path_for(i)
        return {"api": load.call("GET", f"{api}{path}", 200, headers=AUTH)[0],
                "bare": load.call("GET", f"{bare}{path}", 200)[0]}
    return pair
