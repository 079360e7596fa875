"""The invariant checker of the fault and load runs finds what it is there to find.

Each test makes the state a defect would leave (through the lifecycle where it can,
by a direct UPDATE where no code path may lead) and shows that
``tests.invariants.check`` names it; a sound state gives no problem.
"""
from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.dialects.postgresql import insert

from models import db, lifecycle, queries
from models.calls import ToolCall
from models.email import EmailOutbox
from tasks.delivery import attempts
from tasks.delivery import events
from tests.helpers import make_call
from tests.invariants import check


def sent(tool_call_id: str) -> None:
    with db.session() as s:
        s.execute(insert(EmailOutbox).values(tool_call_id=tool_call_id, message_id=f"<{tool_call_id}>",
                                             thread_id="t", headers={}, body=""))


def completed(callback_url: str | None = None) -> str:
    """A send_email call COMPLETED through the lifecycle, its email in the outbox."""
    call = make_call(callback_url=callback_url)
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
        lifecycle.commit_point(s, call.tool_call_id, "SENDING")
        lifecycle.complete(s, call.tool_call_id, {"message_id": "m"}, "Email sent.")
    sent(call.tool_call_id)
    return call.tool_call_id


def forge(tool_call_id: str, **values) -> None:
    with db.session() as s:
        s.execute(update(ToolCall).where(ToolCall.tool_call_id == tool_call_id).values(**values))


def test_a_sound_state_has_no_problem():
    make_call()  # PENDING: waiting for its caller
    completed()
    verdict = check()
    assert verdict.problems == []
    assert verdict.calls == 2 and verdict.side_effects == 1


def test_a_call_left_executing_is_named():
    call = make_call()
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
    assert check().problems == [f"neither terminal nor waiting: {call.tool_call_id} (send_email, EXECUTING, step None)"]


def test_cancelled_after_the_commit_is_named():
    call = make_call()
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
        lifecycle.commit_point(s, call.tool_call_id, "SENDING")
    forge(call.tool_call_id, status="CANCELLED",
          status_history=ToolCall.status_history.op("||")(
              '[{"status": "CANCELLED", "reason": "forged", "at": "2999-01-01T00:00:00+00:00"}]'))
    assert any(p.startswith("CANCELLED with committed_at") for p in check().problems)


def test_an_email_of_a_call_that_did_not_complete_and_a_completed_call_without_one_are_named():
    failed = make_call()
    with db.session() as s:
        lifecycle.confirm(s, failed.tool_call_id)
        lifecycle.fail(s, failed.tool_call_id, "boom", "It failed.")
    sent(failed.tool_call_id)
    silent = completed()
    with db.session() as s:
        s.execute(EmailOutbox.__table__.delete().where(EmailOutbox.tool_call_id == silent))
    problems = check().problems
    assert any(p.startswith("1 email_outbox rows but not a COMPLETED send_email") and failed.tool_call_id in p
               for p in problems), problems
    assert any(p.startswith("COMPLETED with 0 email_outbox rows") and silent in p for p in problems), problems


def test_a_meeting_or_a_to_do_of_a_call_that_did_not_complete_them_is_named():
    """The calendar's and the task list's rows are counted like the outbox's: a meeting booked for a
    cancelled call, a to-do for an email call, and one of no call at all are each named."""
    from datetime import datetime, timedelta, timezone

    from models.calendar import CalendarEvent
    from models.task_list import TodoTask

    from tasks import tools

    cancelled = make_call("schedule_meeting", dict(tools.TOOLS["schedule_meeting"].example))
    with db.session() as s:
        lifecycle.cancel(s, cancelled.tool_call_id, "Changed my mind")
    email = completed()
    when = datetime(2030, 1, 7, 10, tzinfo=timezone.utc)
    with db.session() as s:
        s.add(CalendarEvent(id="ev1", title="Sync", starts_at=when, ends_at=when + timedelta(hours=1),
                            tool_call_id=cancelled.tool_call_id))
        s.add(CalendarEvent(id="demo", title="Demo", starts_at=when, ends_at=when + timedelta(hours=1)))  # a demo row: no call's
        s.add(TodoTask(id="t1", title="Call back", tool_call_id=email))
        s.add(TodoTask(id="t2", title="Stray", tool_call_id="tc_nobody"))
    problems = check().problems
    assert any(p.startswith("1 calendar_events rows but not a COMPLETED schedule_meeting")
               and cancelled.tool_call_id in p for p in problems), problems
    assert any(p.startswith("1 todo_tasks rows but not a COMPLETED create_task") and email in p
               for p in problems), problems
    assert "a todo_tasks row for no call: tc_nobody" in problems, problems
    assert len(problems) == 3, problems


def test_a_stream_with_a_gap_a_repeat_or_an_event_of_no_row_is_named():
    from tests.multihost_traffic import Followers

    followers = Followers(["http://unused"], {}, sessions=0)
    rows = {"s1": [("e1", "tc_a", 1), ("e2", "tc_a", 2), ("e3", "tc_a", 3)], "s2": [("f1", "tc_b", 1)]}
    followers.events["s1"] = [{"event_id": "e1", "tool_call_id": "tc_a", "seq": 1},
                              {"event_id": "e3", "tool_call_id": "tc_a", "seq": 3}]
    followers.events["s2"] = [{"event_id": "f1", "tool_call_id": "tc_b", "seq": 1},
                              {"event_id": "f1", "tool_call_id": "tc_b", "seq": 1},
                              {"event_id": "x9", "tool_call_id": "tc_c", "seq": 1}]
    assert followers.problems(rows) == [
        "stream s1: 1 of 3 events never came, e.g. ['e2']",
        "stream s1: tc_a came as seqs [1, 3]",
        "stream s2: 1 events twice, e.g. ['f1']",
        "stream s2: 1 events of no row of its session",
        "stream s2: tc_b came as seqs [1, 1]",
    ]
    followers.events["s1"].insert(1, {"event_id": "e2", "tool_call_id": "tc_a", "seq": 2})
    followers.events["s2"] = [{"event_id": "f1", "tool_call_id": "tc_b", "seq": 1}]
    assert followers.problems(rows) == []


def test_a_history_the_state_machine_does_not_allow_is_named():
    call = make_call()
    forge(call.tool_call_id, status="COMPLETED", status_history=ToolCall.status_history.op("||")(
        '[{"status": "COMPLETED", "reason": "forged", "at": "2999-01-01T00:00:00+00:00"}]'))
    problems = check().problems
    assert any(p.startswith("PENDING -> COMPLETED not allowed") for p in problems), problems


def test_a_cancel_answered_200_on_a_call_that_is_not_cancelled_is_named():
    tool_call_id = completed()
    assert check(answered_cancelled=[tool_call_id]).problems == [
        f"cancel answered 200 but the call is COMPLETED: {tool_call_id}"]


def test_events_missing_repeated_or_undelivered_at_the_relay_are_named(relay):
    tool_call_id = completed(callback_url=relay.url)
    with db.session() as s:
        call = queries.get(s, tool_call_id)
        first = events.record(s, call, "progress", step="PREPARING", message="one")
        second = events.record(s, call, "completed", message="two")
    assert attempts.attempt(first.event_id).delivered
    problems = check(relay).problems
    assert any(p.startswith("not delivered") and "seq 2" in p for p in problems), problems
    assert any(p.startswith("never received") and "seq 2" in p for p in problems), problems
    assert any(p.startswith("seqs received [1], rows 2") for p in problems), problems

    assert attempts.attempt(second.event_id).delivered
    assert check(relay, once_at_relay=True).problems == []
    relay.events.append(dict(relay.events[0]))  # the same event_id again: at least once allows it
    assert check(relay).problems == [] and check(relay).relay_duplicates == 1
    assert check(relay, once_at_relay=True).problems == [f"1 events received more than once, e.g. {[first.event_id]}"]


def test_an_event_received_twice_is_named_unless_its_first_copy_came_during_a_fault_or_its_row_records_a_failure():
    from types import SimpleNamespace

    from tests.multihost_traffic import HostsTraffic

    traffic = HostsTraffic(["http://a", "http://b"], {}, SimpleNamespace(answer=lambda fn: None), ops=1, seed=0)
    traffic.arrivals.update({"once": [5.0], "in_fault": [10.5, 30.0], "outside": [20.0, 21.0],
                             "retried": [40.0, 41.0], "thrice": [50.0, 51.0, 52.0]})
    # a copy again is excused only by a failed attempt its row records, one for each copy again
    assert traffic.duplicate_problems([(10.0, 12.0)], {"retried": 1, "thrice": 1}) == [
        "event outside received 2 times, its first copy outside every fault, 0 failed attempts recorded",
        "event thrice received 3 times, its first copy outside every fault, 1 failed attempts recorded"]
    assert traffic.resent({"retried": 1, "thrice": 1}) == 2
