"""The state machine (docs/promises.md, "Statuses and transitions"): every transition, every refusal, the
histories, idempotent creation, the TTL sweep, and its behaviour under 50 threads."""
from __future__ import annotations

import threading
from collections import Counter
from datetime import datetime

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError

from models import db, lifecycle, queries
from models.calls import ToolCall
from support.worker_process import queues_taken_from_others
from tasks import app
from tasks.calls import actions
from tests.helpers import make_call, row, wait_status
from tests.invariants import history_problems
from tests.tasklog import TaskLog


def statuses(call: ToolCall) -> list[str]:
    return [entry["status"] for entry in call.status_history]


def assert_valid_history(call: ToolCall) -> None:
    assert history_problems(call) == [], call.status_history


def apply(fn, *args, **kwargs):
    with db.session() as s:
        return fn(s, *args, **kwargs)


def refused(fn, *args, **kwargs) -> lifecycle.Refused:
    """Run a transition that must be refused; show it changed nothing."""
    tool_call_id = args[0]
    before = row(tool_call_id)
    with pytest.raises(lifecycle.Refused) as info:
        apply(fn, *args, **kwargs)
    after = row(tool_call_id)
    for column in ("status", "status_history", "event_seq", "parameters", "parameters_history",
                   "committed_at", "completed_at", "error_message"):
        assert getattr(after, column) == getattr(before, column), column
    return info.value


def to_executing(tool_call_id: str) -> ToolCall:
    return apply(lifecycle.confirm, tool_call_id)


def to_prepared(tool_call_id: str) -> ToolCall:
    to_executing(tool_call_id)
    assert apply(lifecycle.begin_step, tool_call_id, "PREPARING", 0.0) is not None
    return apply(lifecycle.checkpoint, tool_call_id, "READY_TO_SEND", 0.25)


def to_committed(tool_call_id: str) -> ToolCall:
    to_prepared(tool_call_id)
    apply(lifecycle.resume, tool_call_id)
    return apply(lifecycle.commit_point, tool_call_id, "SENDING")


# -- creation ------------------------------------------------------------------------

def test_create_records_pending_with_history():
    call = make_call()
    assert call.status == "PENDING"
    assert call.tool_call_id.startswith("tc_") and len(call.tool_call_id) == 15
    assert [(e["status"], e["reason"]) for e in call.status_history] == [("PENDING", "Recorded")]
    assert call.parameters_history == []
    assert call.committed_at is None and call.completed_at is None


def test_create_replay_with_same_key_returns_the_same_call():
    first = make_call(idempotency_key="key-1")
    tool_params = dict(first.parameters)
    with db.session() as s:
        again, created = lifecycle.create(s, session_id="sess_test", function_name="send_email",
                                          action_level="write", parameters=tool_params, idempotency_key="key-1",
                                          caller="tests")
    assert created is False
    assert again.tool_call_id == first.tool_call_id
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(ToolCall)) == 1


def test_idempotency_keys_are_per_caller_and_a_tool_call_id_is_not():
    """Another caller's key is another call; another caller's tool_call_id is
    IdTaken, which carries nothing of the call that has it."""
    first = make_call(idempotency_key="key-1")
    same = dict(session_id="sess_test", function_name="send_email", action_level="write",
                parameters=dict(first.parameters), idempotency_key="key-1")
    with db.session() as s:
        bobs, created = lifecycle.create(s, **same, caller="bob")
    assert created is True and bobs.tool_call_id != first.tool_call_id and bobs.caller == "bob"
    with db.session() as s:  # a call recorded with no caller has keys of its own too
        nobodys, created = lifecycle.create(s, **same)
    assert created is True and nobodys.caller is None
    with pytest.raises(lifecycle.IdTaken) as info, db.session() as s:
        lifecycle.create(s, **{**same, "idempotency_key": None}, tool_call_id=first.tool_call_id, caller="bob")
    assert info.value.tool_call_id == first.tool_call_id and not hasattr(info.value, "call")
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(ToolCall)) == 3
        assert queries.get(s, first.tool_call_id, caller="tests").tool_call_id == first.tool_call_id
    with pytest.raises(queries.NotFound), db.session() as s:
        queries.get(s, first.tool_call_id, caller="bob")


@pytest.mark.parametrize("change", [
    {"parameters": {"to": "other@example.com", "subject": "Meeting Tomorrow", "body": "", "cc": []}},
    {"session_id": "another_session"},
    {"function_name": "query_vector_db", "action_level": "read"},
])
def test_create_same_key_other_content_is_a_conflict(change):
    first = make_call(idempotency_key="key-1")
    values = dict(session_id="sess_test", function_name="send_email", action_level="write",
                  parameters=dict(first.parameters), idempotency_key="key-1", caller="tests")
    values.update(change)
    with pytest.raises(lifecycle.Refused) as info, db.session() as s:
        lifecycle.create(s, **values)
    assert info.value.code == "idempotency_conflict"
    assert info.value.call.tool_call_id == first.tool_call_id
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(ToolCall)) == 1


def test_create_same_tool_call_id_replays_or_conflicts():
    first = make_call(tool_call_id="tc_given")
    assert make_call(tool_call_id="tc_given").tool_call_id == first.tool_call_id
    with pytest.raises(lifecycle.Refused) as info:
        make_call(tool_call_id="tc_given", parameters={"to": "x@example.com", "subject": "Other"})
    assert info.value.code == "idempotency_conflict"


def test_status_check_constraint_rejects_an_unknown_status():
    call = make_call()
    with pytest.raises(IntegrityError, match="valid_status"), db.session() as s:
        s.execute(text("UPDATE tool_calls SET status = 'DONE' WHERE tool_call_id = :id"), {"id": call.tool_call_id})
    assert row(call.tool_call_id).status == "PENDING"


def test_unknown_call_is_not_found():
    for fn in (lifecycle.confirm, lifecycle.cancel, lifecycle.resume):
        with pytest.raises(queries.NotFound):
            apply(fn, "tc_nope")


# -- modify -------------------------------------------------------------------------

def modify(call: ToolCall, **new) -> ToolCall:
    merged = dict(call.parameters, **new)
    changes = [{"field": k, "old": call.parameters.get(k), "new": v} for k, v in new.items()]
    return apply(lifecycle.modify, call.tool_call_id, old_parameters=call.parameters,
                 new_parameters=merged, changes=changes)


def test_modify_records_parameter_history_and_modified_then_pending():
    call = make_call()
    once = modify(call, to="john.smith@example.com")
    twice = modify(once, subject="Moved", body="See you at 3")
    assert twice.status == "PENDING"
    assert twice.parameters["to"] == "john.smith@example.com" and twice.parameters["subject"] == "Moved"
    assert [(h["field"], h["old"], h["new"]) for h in twice.parameters_history] == [
        ("to", "john@example.com", "john.smith@example.com"),
        ("subject", "Meeting Tomorrow", "Moved"),
        ("body", "", "See you at 3"),
    ]
    assert all(datetime.fromisoformat(h["at"]) for h in twice.parameters_history)
    assert statuses(twice) == ["PENDING", "MODIFIED", "PENDING", "MODIFIED", "PENDING"]
    assert twice.status_history[1]["fields"] == ["to"]
    assert twice.status_history[3]["fields"] == ["subject", "body"]
    assert_valid_history(twice)


def test_modify_on_stale_parameters_is_refused():
    call = make_call()
    modify(call, to="first@example.com")
    exc = refused(lifecycle.modify, call.tool_call_id, old_parameters=call.parameters,
                  new_parameters=dict(call.parameters, to="second@example.com"),
                  changes=[{"field": "to", "old": "john@example.com", "new": "second@example.com"}])
    assert exc.code == "stale"
    assert row(call.tool_call_id).parameters["to"] == "first@example.com"


def test_modify_refused_once_executing_or_terminal():
    call = make_call()
    to_executing(call.tool_call_id)
    exc = refused(lifecycle.modify, call.tool_call_id, old_parameters=call.parameters,
                  new_parameters=dict(call.parameters, to="x@example.com"), changes=[])
    assert (exc.code, exc.status) == ("invalid_status", "EXECUTING")
    assert "EXECUTING" in str(exc)
    apply(lifecycle.cancel, call.tool_call_id)
    exc = refused(lifecycle.modify, call.tool_call_id, old_parameters=call.parameters,
                  new_parameters=dict(call.parameters, to="x@example.com"), changes=[])
    assert (exc.code, exc.status) == ("already_terminal", "CANCELLED")


# -- confirm, checkpoint, resume, complete, fail ------------------------------------------

def test_happy_path_with_checkpoint():
    call = make_call()
    executing = to_executing(call.tool_call_id)
    assert executing.status == "EXECUTING" and executing.confirmed_at is not None
    # a link's statements return the columns a link reads (lifecycle.LINK_COLUMNS): the rest is read back
    step = apply(lifecycle.begin_step, call.tool_call_id, "PREPARING", 0.0)
    assert step.current_step == "PREPARING"
    assert row(call.tool_call_id).executed_at is not None and row(call.tool_call_id).attempts == 1
    recorded = apply(lifecycle.record_step, call.tool_call_id, "PREPARING", {"draft": 1}, 0.25)
    assert recorded.step_outputs == {"PREPARING": {"draft": 1}} and recorded.progress == 0.25
    prepared = apply(lifecycle.checkpoint, call.tool_call_id, "READY_TO_SEND", 0.25)
    assert prepared.status == "PREPARED"
    prepared = row(call.tool_call_id)
    assert prepared.prepared_at is not None and prepared.execution_time_ms is not None
    resumed = apply(lifecycle.resume, call.tool_call_id)
    assert resumed.status == "EXECUTING" and resumed.resumed_at is not None
    committed = apply(lifecycle.commit_point, call.tool_call_id, "SENDING")
    assert committed.committed_at is not None
    done = apply(lifecycle.complete, call.tool_call_id, {"message_id": "m"}, "Email sent.")
    assert done.status == "COMPLETED" and done.progress == 1.0
    done = row(call.tool_call_id)
    assert done.completed_at is not None
    assert done.result == {"message_id": "m"} and done.voice_response == "Email sent."
    assert done.execution_time_ms >= prepared.execution_time_ms
    assert statuses(done) == ["PENDING", "EXECUTING", "PREPARED", "EXECUTING", "COMPLETED"]
    assert [e["reason"] for e in done.status_history][1:] == [
        "Confirmed", "Checkpoint READY_TO_SEND", "Proceeded from its checkpoint", "Completed"]
    assert_valid_history(done)


def test_event_seq_counts_events_not_transitions():
    """A relay tells a missed event by a gap in seq: only recorded events take a number."""
    call = make_call()
    seqs = [call.event_seq, to_executing(call.tool_call_id).event_seq]
    seqs.append(apply(lifecycle.begin_step, call.tool_call_id, "PREPARING", 0.0).event_seq)
    assert seqs == [0, 0, 0]
    seqs += [apply(lifecycle.next_event_seq, call.tool_call_id) for _ in range(3)]
    assert seqs == [0, 0, 0, 1, 2, 3]
    assert apply(lifecycle.cancel, call.tool_call_id).event_seq == 3


def test_fail_records_error_and_voice_response():
    call = make_call()
    to_executing(call.tool_call_id)
    failed = apply(lifecycle.fail, call.tool_call_id, "SMTP said no", "The email was not sent.")
    assert failed.status == "FAILED" and failed.error_message == "SMTP said no"
    assert failed.voice_response == "The email was not sent." and failed.completed_at is not None
    assert statuses(failed) == ["PENDING", "EXECUTING", "FAILED"]
    assert failed.status_history[-1]["reason"] == "SMTP said no"


def test_fail_at_step_applies_only_while_the_call_is_at_that_step():
    """Link.on_failure fails a call only if it is still at the link's own step."""
    call = make_call()
    to_executing(call.tool_call_id)
    apply(lifecycle.begin_step, call.tool_call_id, "PREPARING", 0.0)
    before = row(call.tool_call_id)
    assert apply(lifecycle.fail, call.tool_call_id, "late", "x", at_step="SENDING") is None
    after = row(call.tool_call_id)
    assert (after.status, after.status_history, after.event_seq) == (
        "EXECUTING", before.status_history, before.event_seq)
    failed = apply(lifecycle.fail, call.tool_call_id, "timed out", "x", at_step="PREPARING")
    assert failed.status == "FAILED" and failed.error_message == "timed out"


def test_confirm_refusals_name_the_status():
    call = make_call()
    to_executing(call.tool_call_id)
    exc = refused(lifecycle.confirm, call.tool_call_id)
    assert (exc.code, exc.status) == ("invalid_status", "EXECUTING")
    assert str(exc) == "Cannot confirm a call that is EXECUTING."
    apply(lifecycle.complete, call.tool_call_id, {}, "Done.")
    exc = refused(lifecycle.confirm, call.tool_call_id)
    assert (exc.code, exc.status) == ("already_terminal", "COMPLETED")


def test_resume_refused_unless_prepared():
    call = make_call()
    exc = refused(lifecycle.resume, call.tool_call_id)
    assert (exc.code, exc.status) == ("invalid_status", "PENDING")
    to_prepared(call.tool_call_id)
    apply(lifecycle.resume, call.tool_call_id)
    exc = refused(lifecycle.resume, call.tool_call_id)
    assert (exc.code, exc.status) == ("invalid_status", "EXECUTING")


@pytest.mark.parametrize("fn, args", [
    (lifecycle.begin_step, ("PREPARING", 0.0)),
    (lifecycle.commit_point, ("SENDING",)),
    (lifecycle.record_step, ("PREPARING", {}, 0.5)),
    (lifecycle.checkpoint, ("READY_TO_SEND", 0.25)),
    (lifecycle.complete, ({}, "Done.")),
    (lifecycle.fail, ("boom", "It failed.")),
])
@pytest.mark.parametrize("status", ["PENDING", "PREPARED", "CANCELLED"])
def test_link_transitions_apply_only_while_executing(fn, args, status):
    call = make_call()
    if status == "PREPARED":
        to_prepared(call.tool_call_id)
    elif status == "CANCELLED":
        apply(lifecycle.cancel, call.tool_call_id)
    before = row(call.tool_call_id)
    assert apply(fn, call.tool_call_id, *args) is None
    after = row(call.tool_call_id)
    assert (after.status, after.status_history, after.event_seq, after.committed_at, after.attempts) == (
        before.status, before.status_history, before.event_seq, before.committed_at, before.attempts)


def test_unconfirm_only_before_any_step():
    call = make_call()
    to_executing(call.tool_call_id)
    back = apply(lifecycle.unconfirm, call.tool_call_id)
    assert back.status == "PENDING" and back.confirmed_at is None
    assert statuses(back) == ["PENDING", "EXECUTING", "PENDING"]
    to_executing(call.tool_call_id)
    apply(lifecycle.begin_step, call.tool_call_id, "PREPARING", 0.0)
    assert apply(lifecycle.unconfirm, call.tool_call_id) is None
    assert row(call.tool_call_id).status == "EXECUTING"


def test_the_undo_of_a_resume_applies_only_before_the_next_link_began_and_never_to_a_committed_call():
    """The undo of a resume whose chain the broker refused; a publish whose answer
    was lost may have started the chain, and then there is nothing to undo."""
    refused_by_broker, link_began, committed = make_call(), make_call(), make_call()
    for call in (refused_by_broker, link_began):
        to_prepared(call.tool_call_id)
        apply(lifecycle.resume, call.tool_call_id)
    to_committed(committed.tool_call_id)
    apply(lifecycle.begin_step, link_began.tool_call_id, "SENDING", 0.5)

    back = apply(lifecycle.undo_resume, refused_by_broker.tool_call_id, "READY_TO_SEND")
    assert back.status == "PREPARED" and back.current_step == "READY_TO_SEND"
    assert statuses(back)[-3:] == ["PREPARED", "EXECUTING", "PREPARED"]
    assert_valid_history(back)
    for call in (link_began, committed):
        before = row(call.tool_call_id)
        assert apply(lifecycle.undo_resume, call.tool_call_id, "READY_TO_SEND") is None
        after = row(call.tool_call_id)
        assert (after.status, after.status_history, after.committed_at) == (
            "EXECUTING", before.status_history, before.committed_at)


def test_expiry_never_touches_a_committed_call():
    """A call past its point of no return never ends EXPIRED ("not done"), even
    PREPARED (a tool whose checkpoint follows its side effect)."""
    call = make_call()
    to_committed(call.tool_call_id)
    apply(lifecycle.checkpoint, call.tool_call_id, "CONFIRM_SENT", 0.75)
    backdate(call.tool_call_id, "prepared_at", 10_000)
    backdate(call.tool_call_id, "created_at", 10_000)
    assert apply(queries.stale, pending_ttl_s=1, prepared_ttl_s=1) == []
    assert apply(lifecycle.expire, call.tool_call_id, pending_ttl_s=1, prepared_ttl_s=1) is None
    stored = row(call.tool_call_id)
    assert stored.status == "PREPARED" and stored.committed_at is not None


# -- cancel -----------------------------------------------------------------------------

@pytest.mark.parametrize("status", ["PENDING", "EXECUTING", "PREPARED"])
def test_cancel_from_every_cancellable_status(status):
    call = make_call()
    if status == "EXECUTING":
        to_executing(call.tool_call_id)
    elif status == "PREPARED":
        to_prepared(call.tool_call_id)
    cancelled = apply(lifecycle.cancel, call.tool_call_id)
    assert cancelled.status == "CANCELLED"
    assert cancelled.error_message == "Cancelled by user" and cancelled.completed_at is not None
    assert cancelled.status_history[-2]["status"] == status
    assert cancelled.status_history[-1]["reason"] == "Cancelled by user"
    assert_valid_history(cancelled)


def test_cancel_keeps_a_given_reason():
    call = make_call()
    cancelled = apply(lifecycle.cancel, call.tool_call_id, "Caller changed their mind")
    assert cancelled.error_message == "Caller changed their mind"
    assert cancelled.status_history[-1] == {**cancelled.status_history[-1], "status": "CANCELLED",
                                            "reason": "Caller changed their mind"}


def test_cancel_after_the_point_of_no_return_is_too_late():
    call = make_call()
    to_committed(call.tool_call_id)
    exc = refused(lifecycle.cancel, call.tool_call_id)
    assert (exc.code, exc.status) == ("too_late", "EXECUTING")
    assert exc.call.committed_at is not None


@pytest.mark.parametrize("ending", ["COMPLETED", "FAILED", "CANCELLED", "EXPIRED"])
def test_terminal_calls_refuse_everything(ending):
    call = make_call()
    if ending == "COMPLETED":
        to_executing(call.tool_call_id)
        apply(lifecycle.complete, call.tool_call_id, {}, "Done.")
    elif ending == "FAILED":
        to_executing(call.tool_call_id)
        apply(lifecycle.fail, call.tool_call_id, "boom", "It failed.")
    elif ending == "CANCELLED":
        apply(lifecycle.cancel, call.tool_call_id)
    else:
        with db.session() as s:
            s.execute(text("UPDATE tool_calls SET created_at = now() - interval '1 hour'"))
        assert apply(lifecycle.expire, call.tool_call_id, pending_ttl_s=600, prepared_ttl_s=300) is not None
    for fn in (lifecycle.confirm, lifecycle.cancel, lifecycle.resume):
        exc = refused(fn, call.tool_call_id)
        assert (exc.code, exc.status) == ("already_terminal", ending)
        assert ending in str(exc)


# -- expiry -------------------------------------------------------------------------------

def backdate(tool_call_id: str, column: str, seconds: int) -> None:
    with db.session() as s:
        s.execute(text(f"UPDATE tool_calls SET {column} = now() - make_interval(secs => :s) "
                       "WHERE tool_call_id = :id"), {"s": seconds, "id": tool_call_id})


def test_expire_stale_uses_each_statuses_ttl():
    old_pending, new_pending = make_call(), make_call()
    old_prepared, new_prepared, executing = make_call(), make_call(), make_call()
    to_prepared(old_prepared.tool_call_id)
    to_prepared(new_prepared.tool_call_id)
    to_executing(executing.tool_call_id)
    backdate(old_pending.tool_call_id, "created_at", 601)
    backdate(new_pending.tool_call_id, "created_at", 500)
    backdate(old_prepared.tool_call_id, "prepared_at", 301)
    backdate(new_prepared.tool_call_id, "prepared_at", 200)
    for c in (old_prepared, new_prepared, executing):  # created long ago: only prepared_at counts
        backdate(c.tool_call_id, "created_at", 10_000)
    backdate(executing.tool_call_id, "confirmed_at", 10_000)

    stale = apply(queries.stale, pending_ttl_s=600, prepared_ttl_s=300)
    assert sorted(stale) == sorted([old_pending.tool_call_id, old_prepared.tool_call_id])
    expired = [apply(lifecycle.expire, tool_call_id, pending_ttl_s=600, prepared_ttl_s=300) for tool_call_id in stale]
    for c in expired:
        assert c.status == "EXPIRED" and c.error_message == "Expired unanswered" and c.completed_at is not None
        assert c.status_history[-1]["reason"] == "Expired unanswered"
        assert_valid_history(c)
    assert row(new_pending.tool_call_id).status == "PENDING"
    assert row(new_prepared.tool_call_id).status == "PREPARED"
    assert row(executing.tool_call_id).status == "EXECUTING"
    assert apply(queries.stale, pending_ttl_s=600, prepared_ttl_s=300) == []
    # the statement checks the TTL itself: a call not (or no longer) stale is left alone
    for c in (old_pending, new_pending, new_prepared, executing):
        assert apply(lifecycle.expire, c.tool_call_id, pending_ttl_s=600, prepared_ttl_s=300) is None


def test_stuck_executing_counts_from_the_latest_activity():
    stuck, resumed, later = make_call(), make_call(), make_call()
    to_executing(stuck.tool_call_id)
    apply(lifecycle.begin_step, stuck.tool_call_id, "PREPARING", 0.0)
    backdate(stuck.tool_call_id, "executed_at", 1000)
    backdate(stuck.tool_call_id, "step_started_at", 1000)
    backdate(stuck.tool_call_id, "confirmed_at", 1001)
    # Its first link ran long ago, its current link passed its gate just now: it is not stuck.
    to_executing(later.tool_call_id)
    apply(lifecycle.begin_step, later.tool_call_id, "PREPARING", 0.0)
    for column in ("executed_at", "step_started_at", "confirmed_at"):
        backdate(later.tool_call_id, column, 1000)
    apply(lifecycle.begin_step, later.tool_call_id, "SENDING", 0.5)
    to_prepared(resumed.tool_call_id)
    apply(lifecycle.resume, resumed.tool_call_id)
    # Waited long at its checkpoint, resumed just now: it is not stuck.
    backdate(resumed.tool_call_id, "executed_at", 1000)
    backdate(resumed.tool_call_id, "confirmed_at", 1000)
    assert apply(queries.stuck_executing, 900) == [stuck.tool_call_id]


# -- under concurrency ----------------------------------------------------------------------

def run_together(work):
    """Start every action at once (a Barrier lines the threads up); return outcomes in order."""
    barrier = threading.Barrier(len(work))
    outcomes: list = [None] * len(work)

    def run(i, action):
        barrier.wait()
        try:
            outcomes[i] = ("ok", action())
        except lifecycle.Refused as exc:
            outcomes[i] = ("refused", exc.code, exc.status)
        except Exception as exc:  # noqa: BLE001  (shown in the assertion)
            outcomes[i] = ("error", repr(exc))

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(work)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


@pytest.mark.slow
def test_fifty_confirms_give_one_transition_and_one_enqueue(worker):
    call = make_call()
    with TaskLog() as log:
        with queues_taken_from_others(app, ["tools.send_email"]):  # the chain waits until all have answered
            outcomes = run_together([lambda: actions.confirm(call.tool_call_id)] * 50)
        assert not [o for o in outcomes if o[0] == "error"], outcomes
        assert sum(o[0] == "ok" for o in outcomes) == 1
        assert Counter(o[1:] for o in outcomes if o[0] == "refused") == {("invalid_status", "EXECUTING"): 49}
        prepared = wait_status(call.tool_call_id, "PREPARED")
        assert len(log.published_for(call.tool_call_id, "tools.send_email.PREPARING")) == 1
    assert statuses(prepared).count("EXECUTING") == 1
    assert statuses(prepared) == ["PENDING", "EXECUTING", "PREPARED"]
    assert prepared.workflow_id


def test_fifty_threads_mixing_confirm_and_cancel_agree(worker):
    for _ in range(4):
        call = make_call()
        racers = [lambda: actions.confirm(call.tool_call_id), lambda: actions.cancel(call.tool_call_id)] * 25
        with TaskLog() as log:
            outcomes = run_together(racers)
            assert not [o for o in outcomes if o[0] == "error"], outcomes
            confirms, cancels = outcomes[0::2], outcomes[1::2]
            confirmed = sum(o[0] == "ok" for o in confirms)
            assert sum(o[0] == "ok" for o in cancels) == 1
            final = row(call.tool_call_id)
            assert final.status == "CANCELLED" and final.error_message == "Cancelled by user"
            history = statuses(final)
            assert history.count("CANCELLED") == 1
            assert history.count("EXECUTING") == confirmed <= 1
            assert history in (["PENDING", "CANCELLED"], ["PENDING", "EXECUTING", "CANCELLED"],
                               ["PENDING", "EXECUTING", "PREPARED", "CANCELLED"])
            assert_valid_history(final)
            # Every refusal names a status the call really passed through, with the right code.
            for o in confirms + cancels:
                if o[0] == "refused":
                    assert o[1:] in {("invalid_status", "EXECUTING"), ("invalid_status", "PREPARED"),
                                     ("already_terminal", "CANCELLED")}, o
            assert len(log.published_for(call.tool_call_id, "tools.send_email.PREPARING")) == confirmed
            if confirmed:  # the chain saw the cancel and stopped before the checkpoint or at it
                log.wait_ran(call.tool_call_id, "tools.send_email.PREPARING")
                assert not log.published_for(call.tool_call_id, "tools.send_email.SENDING")
