"""Callback events (CONTRACT section 8): the ``callback_deliveries`` row and payload of each
event a call has, inserted in the same transaction as the transition that caused it.

Every event is recorded, with or without a URL (the session's event stream reads the
same rows). Sending them is ``tasks/delivery/attempts.py``'s.
"""
from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Row, bindparam, case, cast, func, insert, literal, null, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert
from sqlalchemy.types import DateTime, String, Text

from models import db, lifecycle, settings
from models.calls import EXECUTING, PENDING, PREPARED, CallbackDelivery, ToolCall
from tasks.worker import metrics

ENDINGS = ("completed", "failed", "cancelled", "expired")  # the events of a call's final status

def actions_available(status: str) -> list[str]:
    return {
        PENDING: ["confirm", "modify", "cancel"],
        EXECUTING: ["cancel"],
        PREPARED: ["proceed", "cancel"],
    }.get(status, [])


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
    """Insert the ``kind`` event's row for a transition that did not insert it itself (a cancel,
    an expiry, a failure); return it to be delivered (None: no URL takes this event).

    ``call`` is the row a transition just returned in this transaction. The row is the one
    :func:`event` describes, for the call as it is now (its ``current_step`` when no
    ``step`` is given, its ``progress``), inserted by one statement that also takes the
    call's next event number (``lifecycle.record_event``): one builder of the payload,
    whichever statement inserts it.
    """
    described = event(kind, step=step or call.current_step, gate=gate, progress=call.progress, message=message,
                      cancellable=cancellable, requires_confirmation=requires_confirmation, preview=preview,
                      context_key=context_key, inline=inline)
    row = lifecycle.record_event(s, call.tool_call_id, described)
    if kind in ENDINGS:  # every ending records its event once: counted when it has committed
        db.after_commit(s, metrics.call_ended, call.function_name, call.status)
    return delivery_of(row)


class Event:
    """A callback event to record in the statement of the transition that causes it
    (``lifecycle.record_step(..., event=...)``); made by :func:`event`."""

    def __init__(self, shape: tuple[str, bool, bool], params: dict[str, Any]):
        self.shape = shape  # (event, requires_confirmation, inline): what the INSERT looks like
        self.params = params

    def build(self, moved: Any) -> Insert:
        return _event_insert(moved, *self.shape)


def event(
    event: str,
    *,
    step: str | None,
    gate: int | None,
    progress: float | None,
    message: str = "",
    cancellable: bool = False,
    requires_confirmation: bool = False,
    preview: dict[str, Any] | None = None,
    context_key: str | None = None,
    inline: bool = False,
) -> Event:
    """The one description of an event's row and payload, for the statement that inserts it: the
    transition that causes it (a link's: ``lifecycle.record_step(..., event=...)``), or
    :func:`record`'s.

    The ``INSERT ... SELECT`` takes what Python knows now as parameters and the rest from
    the call's row as that statement left it (``moved``): its columns, its new
    ``event_seq`` (the event's ``seq``), its actions and its URL (the call's
    ``callback_urls[event]`` if it names one, else its ``callback_url``). Every event is
    recorded, with or without a URL: the session's event stream
    (``GET /voice-tools/events/<session_id>``) reads the same rows. ``progress`` is the
    progress the transition sets. ``inline``: the caller posts it at once
    (``callback_delivery.deliver_inline``), so the row is inserted already claimed for that
    attempt. The returned row is turned back into a delivery by :func:`delivery_of`.
    """
    cfg = settings.load()
    event_id = uuid.uuid4().hex
    constant: dict[str, Any] = {
        "event_id": event_id, "type": "tool_status", "event": event, "step": step, "gate": gate,
        "progress": progress, "message": message, "cancellable": cancellable,
        "requires_confirmation": requires_confirmation, "preview": preview,
        "context_available": context_key is not None, "context_key": context_key,
    }
    return Event((event, requires_confirmation, inline), {
        "ev_id": event_id, "ev_constant": constant, "ev_step": step,
        "ev_voice": message if event != "progress" else None,
        "ev_resume": f"{cfg.public_url}/voice-tools/resume/",
        "ev_lease": datetime.now(timezone.utc) + timedelta(seconds=lease_s(cfg.callback_timeout)),
    })


def _event_insert(moved: Any, event: str, requires_confirmation: bool, inline: bool) -> Insert:
    """The INSERT of an :class:`Event`'s row (bind parameters ``ev_*``) from the transition's row ``moved``."""
    def text_param(name: str) -> Any:
        return bindparam(name, type_=Text)

    url = func.coalesce(func.nullif(moved.c.callback_urls.op("->>")(event), ""), func.nullif(moved.c.callback_url, ""))
    resume_url = text_param("ev_resume") + moved.c.tool_call_id if requires_confirmation else null()
    actions = case({status: cast(bindparam(None, actions_available(status), type_=JSONB), JSONB)
                    for status in (PENDING, EXECUTING, PREPARED)},
                   value=moved.c.status, else_=cast(literal("[]"), JSONB))
    row = func.jsonb_build_object(
        "tool_call_id", moved.c.tool_call_id, "intent_id", moved.c.intent_id,
        "session_id", moved.c.session_id, "function_name", moved.c.function_name,
        "parameters", moved.c.parameters, "status", moved.c.status, "resume_url", resume_url,
        "actions_available", actions, "result", moved.c.result,
        "voice_response", func.coalesce(func.nullif(moved.c.voice_response, ""), text_param("ev_voice")),
        "execution_time_ms", moved.c.execution_time_ms, "seq", moved.c.event_seq,
    )
    if event == "checkpoint":  # the names seed 000's /tool-checkpoint handler reads
        row = row.op("||")(func.jsonb_build_object("checkpoint", bindparam("ev_step", type_=String),
                                                   "resume_webhook", resume_url))
    payload = bindparam("ev_constant", type_=JSONB).op("||")(row)
    lease = bindparam("ev_lease", type_=DateTime(timezone=True))
    chosen = select(
        bindparam("ev_id", type_=String), moved.c.tool_call_id, moved.c.session_id, literal(event),
        moved.c.event_seq, payload, url, case((url.is_(None), "none"), else_="pending"), literal(0),
        case((url.is_not(None), lease), else_=None) if inline else null(),
    )
    return insert(CallbackDelivery).from_select(
        ["event_id", "tool_call_id", "session_id", "event", "seq", "payload", "url", "state", "attempts",
         "next_attempt_at"], chosen,
    ).returning(CallbackDelivery.event_id.label("delivery_event_id"), CallbackDelivery.url.label("delivery_url"),
                CallbackDelivery.payload.label("delivery_payload"), CallbackDelivery.event.label("delivery_event"))


def delivery_of(row: Row[Any] | None) -> CallbackDelivery | None:
    """The delivery to post from a transition's row that recorded its event with :func:`event`
    (None: no URL takes the event, or the transition did not apply)."""
    if row is None or row.delivery_url is None:
        return None
    return CallbackDelivery(event_id=row.delivery_event_id, tool_call_id=row.tool_call_id, session_id=row.session_id,
                            event=row.delivery_event, seq=row.event_seq, payload=row.delivery_payload,
                            url=row.delivery_url, state="pending", attempts=0)


def lease_s(timeout: float) -> float:
    """How long an attempt holds its row: the request's timeout and some slack."""
    return timeout + 5
