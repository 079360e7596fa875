"""A call's callback event: the one builder of its ``callback_deliveries`` row and payload (SQL),
inserted by the statement of the transition that causes it.

Every event is recorded, with or without a URL (the session's event stream reads the
same rows). :func:`event` describes one; a transition of ``models/lifecycle.py`` inserts
it (``event=``, or ``lifecycle.record_event`` after a transition that did not);
:func:`delivery_of` turns the returned row into the delivery to post
(``tasks/delivery/``).
"""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Row, and_, bindparam, case, false, func, insert, literal, literal_column, null, select, true
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.dml import Insert
from sqlalchemy.types import DateTime, String, Text

from models import settings
import voice_tools_tracing as tracing
from models.calls import (CANCELLED, COMPLETED, EXECUTING, EXPIRED, FAILED, MODIFIED, PENDING, PREPARED,
                          CallbackDelivery)


# every kind of event, and the status a call has in the event of each kind (the OpenAPI document's event schemas)
KINDS = ("progress", "checkpoint", "completed", "failed", "cancelled", "expired")
STATUS_OF = {"progress": EXECUTING, "checkpoint": PREPARED, "completed": COMPLETED, "failed": FAILED,
             "cancelled": CANCELLED, "expired": EXPIRED}


# what a call in each open status offers its caller, before its point of no return (lifecycle's transitions:
# confirm and modify from PENDING, proceed from PREPARED, cancel from any open status until committed_at is set)
OFFERED = {
    PENDING: ("confirm", "modify", "cancel"),
    MODIFIED: ("cancel",),
    EXECUTING: ("cancel",),
    PREPARED: ("proceed", "cancel"),
}


def offers(status: str, committed: bool) -> tuple[list[str], bool]:
    """``(actions_available, cancellable)`` of a call in ``status``, ``committed`` if past its point of no
    return (``committed_at`` set): the one place both are derived, for every event and every record. Past the
    point of no return nothing cancels the call, so ``cancel`` is not offered and it is not cancellable."""
    actions = [action for action in OFFERED.get(status, ()) if not (committed and action == "cancel")]
    return actions, "cancel" in actions


def lease_s(timeout: float) -> float:
    """How long an attempt holds its row: the request's timeout and some slack."""
    return timeout + 5


class Event:
    """A callback event to insert by the statement of the transition that causes it; made by :func:`event`.

    ``build(moved)`` is the INSERT of its row from the transition's returned row (a CTE
    named ``moved`` whose ``event_seq`` is the event's number), the same for every event
    of one ``shape``, with ``params`` for its bind parameters. ``numbered``: the statement is
    its own transaction (autocommit), so it takes the row's place in the stream's order
    itself (``commit_seq``, under the lock that orders them, held until its commit; migration
    0017); in a longer transaction the row is numbered at the commit, by the trigger.
    """

    def __init__(self, shape: tuple[str, bool, bool], params: dict[str, Any]):
        self.shape = shape  # (event, requires_confirmation, inline): what the INSERT looks like
        self.params = params

    def build(self, moved: Any, numbered: bool = False) -> Insert:
        return _insert(moved, *self.shape, numbered=numbered)


def event(
    event: str,
    *,
    step: str | None,
    gate: int | None,
    progress: float | None,
    message: str = "",
    requires_confirmation: bool = False,
    preview: dict[str, Any] | None = None,
    context_key: str | None = None,
    inline: bool = False,
) -> Event:
    """The one description of an event's row and payload, for the transition that inserts it.

    The ``INSERT ... SELECT`` takes what Python knows now as parameters and the rest from
    the call's row as that statement left it (``moved``): its columns, its new
    ``event_seq`` (the event's ``seq``), what it offers (its ``actions_available`` and
    ``cancellable``: :func:`offers` of its status and ``committed_at``) and its URL (the call's
    ``callback_urls[event]`` if it names one, else its ``callback_url``). ``progress`` is
    the progress the transition sets. ``inline``: the caller posts it at once, so the row
    is inserted already claimed for that attempt (``next_attempt_at`` a lease ahead).
    """
    cfg = settings.load()
    event_id = uuid.uuid4().hex
    constant: dict[str, Any] = {
        "event_id": event_id, "type": "tool_status", "event": event, "step": step, "gate": gate,
        "progress": progress, "message": message,
        "requires_confirmation": requires_confirmation, "preview": preview,
        "context_available": context_key is not None, "context_key": context_key,
        **tracing.current_ids(),  # with tracing on: the span that made the event (trace_id, span_id)
    }
    return Event((event, requires_confirmation, inline), {
        "ev_id": event_id, "ev_constant": constant, "ev_step": step,
        "ev_voice": message if event != "progress" else None,
        "ev_resume": f"{cfg.public_url}/voice-tools/resume/",
        "ev_lease": datetime.now(timezone.utc) + timedelta(seconds=lease_s(cfg.callback_timeout)),
    })


def _insert(moved: Any, event: str, requires_confirmation: bool, inline: bool, numbered: bool = False) -> Insert:
    """The INSERT of an :class:`Event`'s row (bind parameters ``ev_*``) from the transition's row ``moved``
    (``numbered``: with its ``commit_seq``, see :class:`Event`)."""
    def text_param(name: str) -> Any:
        return bindparam(name, type_=Text)

    url = func.coalesce(func.nullif(moved.c.callback_urls.op("->>")(event), ""), func.nullif(moved.c.callback_url, ""))
    resume_url = text_param("ev_resume") + moved.c.tool_call_id if requires_confirmation else null()
    actions, cancellable = _offered(moved)
    row = func.jsonb_build_object(
        "tool_call_id", moved.c.tool_call_id, "intent_id", moved.c.intent_id,
        "session_id", moved.c.session_id, "function_name", moved.c.function_name,
        "parameters", moved.c.parameters, "status", moved.c.status, "resume_url", resume_url,
        "actions_available", actions, "cancellable", cancellable, "result", moved.c.result,
        "voice_response", func.coalesce(func.nullif(moved.c.voice_response, ""), text_param("ev_voice")),
        "execution_time_ms", moved.c.execution_time_ms, "seq", moved.c.event_seq,
        "outcome", moved.c.outcome,  # done / not_done / unconfirmed once the call has ended, else null
    )
    if event == "checkpoint":  # the names a relay's /tool-checkpoint handler reads
        row = row.op("||")(func.jsonb_build_object("checkpoint", bindparam("ev_step", type_=String),
                                                   "resume_webhook", resume_url))
    payload = bindparam("ev_constant", type_=JSONB).op("||")(row)
    lease = bindparam("ev_lease", type_=DateTime(timezone=True))
    chosen = select(
        bindparam("ev_id", type_=String), moved.c.tool_call_id, moved.c.session_id, literal(event),
        moved.c.event_seq, payload, url, case((url.is_(None), "none"), else_="pending"), literal(0),
        case((url.is_not(None), lease), else_=None) if inline else null(),
        *([func.voice_tools_event_number()] if numbered else []),
    )
    return insert(CallbackDelivery).from_select(
        ["event_id", "tool_call_id", "session_id", "event", "seq", "payload", "url", "state", "attempts",
         "next_attempt_at", *(["commit_seq"] if numbered else [])], chosen,
    ).returning(CallbackDelivery.event_id.label("delivery_event_id"), CallbackDelivery.url.label("delivery_url"),
                CallbackDelivery.payload.label("delivery_payload"), CallbackDelivery.event.label("delivery_event"))


def _offered(moved: Any) -> tuple[Any, Any]:
    """:func:`offers` in SQL, over the row ``moved``: its ``actions_available`` (jsonb) and ``cancellable``,
    the table written out as constants of the statement (no parameters to send at each run)."""
    def actions_sql(actions: list[str]) -> Any:  # our own names (actions, statuses): letters only, safe to write out
        return literal_column(f"'{json.dumps(actions)}'::jsonb", JSONB)

    committed = moved.c.committed_at.is_not(None)
    actions_when, cancellable_when = [], []
    for status in OFFERED:
        for past in (False, True):
            actions, cancellable = offers(status, past)
            when = and_(moved.c.status == literal_column(f"'{status}'"), committed if past else ~committed)
            actions_when.append((when, actions_sql(actions)))
            cancellable_when.append((when, true() if cancellable else false()))
    return case(*actions_when, else_=actions_sql([])), case(*cancellable_when, else_=false())


def delivery_of(row: Row[Any] | None) -> CallbackDelivery | None:
    """The delivery to post from a transition's row that inserted an :class:`Event`
    (None: no URL takes the event, or the transition did not apply)."""
    if row is None or row.delivery_url is None:
        return None
    return CallbackDelivery(event_id=row.delivery_event_id, tool_call_id=row.tool_call_id, session_id=row.session_id,
                            event=row.delivery_event, seq=row.event_seq, payload=row.delivery_payload,
                            url=row.delivery_url, state="pending", attempts=0)
