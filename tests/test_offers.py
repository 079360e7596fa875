"""What a call offers (``actions_available``) and whether it is ``cancellable`` say the same thing, on
every event, in the record on every face, and they are what the state machine then does.

For every status, before and after the point of no return, the event a transition inserts, the
record REST answers and the record MCP answers offer the same actions, an event is ``cancellable``
exactly when it offers ``cancel``, and each action is offered exactly when its compare-and-set
applies (tried in a transaction rolled back). A send_email run end to end offers no cancel once it
is SENDING.
"""
from __future__ import annotations

import pytest
from sqlalchemy import text

from models import db, events, lifecycle, queries
from models.calls import STATUSES
from tasks.calls import actions, operations
from tests.helpers import make_call, row

ACTIONS = ("confirm", "modify", "cancel", "proceed")


class Undone(Exception):
    """Raised to roll a tried transition back."""


def applies(tool_call_id: str, action: str) -> bool:
    """Whether ``action``'s compare-and-set applies to the call as it is (rolled back either way)."""
    try:
        with db.session() as s:
            call = queries.get(s, tool_call_id)
            try:
                if action == "confirm":
                    lifecycle.confirm(s, tool_call_id)
                elif action == "modify":
                    new = {**call.parameters, "subject": "Changed"}
                    lifecycle.modify(s, tool_call_id, old_parameters=call.parameters, new_parameters=new,
                                     changes=[{"field": "subject", "old": call.parameters["subject"],
                                               "new": "Changed"}])
                elif action == "cancel":
                    lifecycle.cancel(s, tool_call_id)
                else:
                    lifecycle.resume(s, tool_call_id)
            except lifecycle.Refused:
                raise Undone(False)
            raise Undone(True)
    except Undone as undone:
        return undone.args[0]


def put(tool_call_id: str, status: str, committed: bool) -> None:
    with db.session() as s:
        s.execute(text("UPDATE tool_calls SET status = :status, "
                       "committed_at = CASE WHEN :committed THEN now() ELSE NULL END WHERE tool_call_id = :id"),
                  {"status": status, "committed": committed, "id": tool_call_id})


def event_payload(tool_call_id: str) -> dict:
    """The payload of an event inserted for the call as it is now (by the one builder, as a transition does)."""
    with db.statement() as s:
        inserted = lifecycle.record_event(s, tool_call_id, events.event("progress", step="PREPARING", gate=1,
                                                                        progress=0.25, message="Preparing."))
    return inserted.delivery_payload


@pytest.mark.parametrize("committed", [False, True], ids=["before the point of no return", "after it"])
@pytest.mark.parametrize("status", STATUSES)
def test_every_status_offers_what_its_transitions_do_and_calls_it_cancellable_only_with_cancel(status, committed):
    tool_call_id = make_call().tool_call_id
    put(tool_call_id, status, committed)
    payload = event_payload(tool_call_id)
    record, _ = operations.status(tool_call_id, None)
    offered = payload["actions_available"]
    assert record["actions_available"] == offered, (record["actions_available"], offered)
    assert payload["cancellable"] is ("cancel" in offered), payload
    assert {action for action in ACTIONS if applies(tool_call_id, action)} == set(offered), offered
    assert row(tool_call_id).status == status  # every try was rolled back


def test_a_send_email_offers_no_cancel_once_it_is_sending(worker, relay):
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "checkpoint")
    actions.resume(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "completed")
    seen = [(e["event"], e["step"], e["cancellable"], e["actions_available"])
            for e in relay.events_for(call.tool_call_id)]
    assert seen == [("progress", "PREPARING", True, ["cancel"]),
                    ("checkpoint", "READY_TO_SEND", True, ["proceed", "cancel"]),
                    ("progress", "SENDING", False, []),
                    ("completed", "COMPLETED", False, [])], seen
