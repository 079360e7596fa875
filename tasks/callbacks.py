"""Callback events (CONTRACT section 8): the ``callback_deliveries`` row and payload of each
event a call has, inserted in the same transaction as the transition that caused it.

Every event is recorded, with or without a URL (the session's event stream reads the
same rows). Sending them is ``tasks/callback_delivery.py``'s.
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
from tasks import worker_metrics

EVENTS = ("progress", "checkpoint", "completed", "failed", "cancelled", "expired")
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
    event: str,
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
    """Insert the event's row; return it to be delivered (None: no URL takes this event).

    Every event is recorded, with or without a URL: the session's event stream
    (``GET /voice-tools/events/<session_id>``) reads the same rows.

    The URL is the call's ``callback_urls[event]`` if it names one, else its
    ``callback_url``.

    ``call`` is the row a transition just returned; ``seq`` is the call's next event number.
    ``inline``: the caller will post it at once with :func:`deliver_inline`, so the row
    is inserted already claimed for that attempt (no second statement to claim it).
    """
    url = url_for(call, event)
    event_id = uuid.uuid4().hex
    seq = lifecycle.next_event_seq(s, call.tool_call_id)
    public = settings.load().public_url
    resume_url = f"{public}/voice-tools/resume/{call.tool_call_id}" if requires_confirmation else None
    payload = {
        "event_id": event_id,
        "type": "tool_status",
        "event": event,
        "tool_call_id": call.tool_call_id,
        "intent_id": call.intent_id,
        "session_id": call.session_id,
        "function_name": call.function_name,
        "parameters": call.parameters,
        "status": call.status,
        "step": step or call.current_step,
        "gate": gate,
        "progress": call.progress,
        "message": message,
        "cancellable": cancellable,
        "requires_confirmation": requires_confirmation,
        "preview": preview,
        "resume_url": resume_url,
        "actions_available": actions_available(call.status),
        "result": call.result,
        "voice_response": call.voice_response or (message if event != "progress" else None),
        "execution_time_ms": call.execution_time_ms,
        "context_available": context_key is not None,
        "context_key": context_key,
        "seq": seq,
    }
    if event == "checkpoint":  # the names seed 000's /tool-checkpoint handler reads
        payload.update(checkpoint=step or call.current_step, resume_webhook=resume_url)
    lease = datetime.now(timezone.utc) + timedelta(seconds=lease_s(settings.load().callback_timeout))
    delivery = CallbackDelivery(
        event_id=event_id, tool_call_id=call.tool_call_id, session_id=call.session_id, event=event, seq=seq,
        payload=payload, url=url, state="pending" if url else "none", attempts=0,
        next_attempt_at=lease if inline and url else None,
    )
    s.add(delivery)
    if event in ENDINGS:  # every ending records its event once: counted when it has committed
        db.after_commit(s, worker_metrics.call_ended, call.function_name, call.status)
    return delivery if url else None


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
    step: str,
    gate: int,
    progress: float,
    message: str = "",
    cancellable: bool = False,
    requires_confirmation: bool = False,
    preview: dict[str, Any] | None = None,
    context_key: str | None = None,
    inline: bool = False,
) -> Event:
    """The event :func:`record` would insert, for the transition's own statement to insert.

    A link's transitions take their event in the statement that changes the call: the
    ``INSERT ... SELECT`` from the updated row (``moved``) writes the same row and payload
    :func:`record` writes (what Python knows now as parameters; the row's columns, its new
    ``event_seq`` and its URL from the row). ``progress`` is the progress the transition
    sets. The returned row is turned back into a delivery by :func:`delivery_of`.
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


def url_for(call: ToolCall, event: str) -> str | None:
    """Where ``event`` of ``call`` goes: its own URL in ``callback_urls``, else ``callback_url``."""
    return (call.callback_urls or {}).get(event) or call.callback_url


def lease_s(timeout: float) -> float:
    """How long an attempt holds its row: the request's timeout and some slack."""
    return timeout + 5
