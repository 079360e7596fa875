"""Recording a call's event after a transition that did not insert it itself (a cancel, an
expiry, a failure), and counting the call's end once that has committed; a cancel with its
sentence and its event, whoever asks for it (a caller, an operator, the relay's answer).

The row and its payload are built by ``models/events.py`` (the one builder, whichever
statement inserts it); sending them is ``tasks/delivery/attempts.py``'s.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from models import db, events, lifecycle
from models.calls import CallbackDelivery, ToolCall
from tasks import tools
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
                              message=message, requires_confirmation=requires_confirmation, preview=preview,
                              context_key=context_key, inline=inline)
    row = lifecycle.record_event(s, call.tool_call_id, described)
    if kind in ENDINGS:  # every ending records its event once: counted when it has committed
        db.after_commit(s, metrics.call_ended, call.function_name, call.status)
    return events.delivery_of(row)


def cancel(tool_call_id: str, reason: str | None, *, caller: str | None = None,
           inline: bool = False, acted: lifecycle.Acted | None = None) -> tuple[ToolCall, CallbackDelivery | None]:
    """Cancel the call (``lifecycle.cancel``: only before the point of no return; ``caller``: only
    that caller's call; ``acted``: who asked, through which face) with the tool's cancelled sentence as its ``voice_response`` and its one
    ``cancelled`` event, in one transaction; the call and the event to send. A call of a tool this
    process does not run can be cancelled too. Raises what ``lifecycle.cancel`` raises."""
    with db.session() as s:
        call = lifecycle.cancel(s, tool_call_id, reason, caller=caller, acted=acted)
        tool = tools.get(call.function_name)
        voice = tool.say(tool.cancelled_response, call.parameters) if tool else "Cancelled."
        call = lifecycle.set_voice_response(s, tool_call_id, voice)
        return call, record(s, call, "cancelled", message=voice, inline=inline)
