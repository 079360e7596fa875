"""Small helpers shared by the tests: make calls, read rows, wait for a status."""
from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from models import db, lifecycle, queries
from models.calls import TERMINAL, CallbackDelivery, ToolCall
from tasks import tools
from tasks.worker import metrics


def make_call(function_name: str = "send_email", parameters: dict[str, Any] | None = None,
              session_id: str = "sess_test", callback_url: str | None = None, **kw: Any) -> ToolCall:
    """A PENDING call recorded as the tests' token ("tests", conftest's AUTH) records it, unless ``caller=``."""
    kw.setdefault("caller", "tests")
    tool = tools.TOOLS[function_name]
    if parameters is None:
        parameters = {"to": "john@example.com", "subject": "Meeting Tomorrow"}
    parameters = tool.schema().load(parameters)
    with db.session() as s:
        call, _ = lifecycle.create(s, session_id=session_id, function_name=function_name,
                                   action_level=tool.action_level, parameters=parameters,
                                   callback_url=callback_url, **kw)
    return call


def row(tool_call_id: str) -> ToolCall:
    with db.session() as s:
        return queries.get(s, tool_call_id)


def wait_status(tool_call_id: str, statuses: tuple[str, ...] | str = TERMINAL, timeout: float = 15.0) -> ToolCall:
    """Poll the row until its status is one of ``statuses`` (tests only)."""
    if isinstance(statuses, str):
        statuses = (statuses,)
    deadline = time.monotonic() + timeout
    while True:
        call = row(tool_call_id)
        if call.status in statuses:
            return call
        if time.monotonic() > deadline:
            raise AssertionError(f"{tool_call_id} is {call.status} after {timeout}s, wanted {statuses}")
        time.sleep(0.02)


def deliveries(tool_call_id: str, event: str | None = None, settle_s: float = 5.0) -> list[CallbackDelivery]:
    """The call's callback rows (of one event type if given), in ``seq`` order, once none is in flight.

    A row ``pending`` with no attempt recorded is on its way: being posted, or posted and its delivered
    attempt waiting for its worker's recording thread (``tasks/delivery/delivered.py``, a moment later);
    a failed attempt is recorded at once. Waited for, up to ``settle_s`` seconds (then the rows as they
    are: a worker that died leaves its rows so, for the retry sweep)."""
    stmt = select(CallbackDelivery).where(CallbackDelivery.tool_call_id == tool_call_id)
    if event:
        stmt = stmt.where(CallbackDelivery.event == event)
    deadline = time.monotonic() + settle_s
    while True:
        with db.session() as s:
            rows = list(s.scalars(stmt.order_by(CallbackDelivery.seq)))
        if time.monotonic() >= deadline or not any(r.state == "pending" and r.attempts == 0 for r in rows):
            return rows
        time.sleep(0.02)


def progress_event(callback_url: str) -> tuple[str, str]:
    """A send_email call EXECUTING its first step with a recorded, cancellable progress event."""
    from tasks.delivery import events

    call = make_call(callback_url=callback_url)
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
        lifecycle.begin_step(s, call.tool_call_id, "PREPARING", 0.0)
        recorded = lifecycle.record_step(s, call.tool_call_id, "PREPARING", {}, 0.25)
        event = events.record(s, recorded, "progress", step="PREPARING", gate=1,
                                 message="Preparing the email to john@example.com.")
    return call.tool_call_id, event.event_id


def delivery(event_id: str) -> CallbackDelivery:
    with db.session() as s:
        return s.scalars(select(CallbackDelivery).where(CallbackDelivery.event_id == event_id)).one()


def wait_delivered(event_id: str, timeout: float = 30.0) -> CallbackDelivery:
    """Poll the delivery row until it is delivered (tests only)."""
    deadline = time.monotonic() + timeout
    while True:
        found = delivery(event_id)
        if found.state == "delivered":
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{event_id} is {found.state} after {found.attempts} attempts: {found.attempt_log}")
        time.sleep(0.05)


def counted(name: str, **labels: str) -> float:
    """A worker series' value in this process (the in-process worker records into it)."""
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0
