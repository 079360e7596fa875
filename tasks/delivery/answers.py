"""What the relay's answer to an event does: ``{"cancel": true, "reason": ...}`` to a cancellable
event (a progress event still ``cancellable``, a checkpoint) cancels the call while it is
still cancellable, announced by its one ``cancelled`` event; any other answer (``{"continue":
true}``, an empty or non-JSON body, an error status, no answer) lets it go on.

The cancel is the ground floor's compare-and-set (``lifecycle.cancel``: no cancel once the
point of no return is passed) with the tool's cancelled sentence; the chain stops at its
next link's gate. Sending the ``cancelled`` event is the caller's (``tasks/delivery/attempts.py``).
"""
from __future__ import annotations

import json
import logging
from typing import Any

from models import lifecycle, queries
from models.calls import CallbackDelivery
from tasks.delivery import events

log = logging.getLogger(__name__)

REASON = "Cancelled by the relay"  # when the answer gives none
ACTED: lifecycle.Acted = {"by": "relay", "via": "callback"}  # the call's own relay, answering its callback


def read(raw: bytes) -> tuple[bool, str | None]:
    """``(cancel, reason)`` from the bytes of a delivered answer: only a JSON object with
    ``"cancel": true`` cancels; its ``reason`` counts when it is a string."""
    try:
        answer: Any = json.loads(raw) if raw else None
    except ValueError:
        return False, None
    if not (isinstance(answer, dict) and answer.get("cancel") is True):
        return False, None
    reason = answer.get("reason")
    return True, reason if isinstance(reason, str) else None


def answers_a_cancel(payload: dict[str, Any]) -> bool:
    """Whether a cancel answering this event counts: a cancellable event, or a checkpoint."""
    return bool(payload.get("cancellable")) or payload.get("event") == "checkpoint"


def cancel(tool_call_id: str, reason: str | None) -> CallbackDelivery | None:
    """Cancel the call as the relay asked, with its ``cancelled`` event recorded in the same
    transaction; return that event to send (None: nothing to send, or the call is no longer
    cancellable: it went on, or it ended meanwhile)."""
    try:
        return events.cancel(tool_call_id, reason or REASON, acted=ACTED)[1]
    except (lifecycle.Refused, queries.NotFound) as exc:
        log.info("relay asked to cancel %s: %s", tool_call_id, exc)
        return None
