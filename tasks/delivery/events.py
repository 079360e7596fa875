"""Recording a call's event after a transition that did not insert it itself (a cancel, an
expiry, a failure), and counting the call's end once that has committed.

The row and its payload are built by ``models/events.py`` (the one builder, whichever
statement inserts it); sending them is ``tasks/delivery/attempts.py``'s.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from models import db, events, lifecycle
from models.calls import CallbackDelivery, ToolCall
from tasks.worker import metrics

ENDINGS = ("completed", "failed", "cancelled", "expired")  # the events of a call's final status


def record(
    s: Session,
    call: ToolCall,
    kind: str,
    *,
    step: str | None = None,
    gate: int | None = None,
    message: str = "",
    cancellable: bool = False,
    requires_confirmation: bool = False,
    preview: dict[str, Any] | None = None,
    context_key: str | None = None,
    inline: bool = False,
) -> CallbackDelivery | None:
    """Insert the ``kind`` event's row in the caller's transaction; return it to be delivered
    (None: no URL takes this event).

    ``call`` is the row a transition just returned in this transaction. The row is the one
    ``models.events.event`` describes, for the call as it is now (its ``current_step`` when
    no ``step`` is given, its ``progress``), inserted by one statement that also takes the
    call's next event number (``lifecycle.record_event``).
    """
    described = events.event(kind, step=step or call.current_step, gate=gate, progress=call.progress,
                              message=message, cancellable=cancellable,
                              requires_confirmation=requires_confirmation, preview=preview,
                              context_key=context_key, inline=inline)
    row = lifecycle.record_event(s, call.tool_call_id, described)
    if kind in ENDINGS:  # every ending records its event once: counted when it has committed
        db.after_commit(s, metrics.call_ended, call.function_name, call.status)
    return events.delivery_of(row)
