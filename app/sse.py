"""The event stream's Server-Sent Events frames: the opening comment with its ``retry:`` hint, an event, a keep-alive."""
from __future__ import annotations

import json
from typing import Any

RETRY_MS = 2000  # the stream's ``retry:`` hint: how long a client waits before reconnecting
OPENING = f": voice-tools event stream\nretry: {RETRY_MS}\n\n"
KEEPALIVE = ": keep-alive\n\n"


def frame(event_id: str, payload: dict[str, Any]) -> str:
    """One event: ``id:`` its event_id, ``event:`` its kind, ``data:`` the callback body as JSON."""
    return f"id: {event_id}\nevent: {payload['event']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
