"""The chain engine with a real worker and a real relay:
gates, checkpoint and resume, the point of no return, clean stops, redelivery,
retries and failures."""
from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import pytest
from marshmallow import Schema, fields
from sqlalchemy import func, select, text

from models import db, lifecycle
from models.calls import SessionContext
from models.email import EmailOutbox
from tasks import chains, tools
from tasks.calls import actions
from tasks.tools import PermanentError, Step, Tool, TransientError
from tests.conftest import AUTH
from tests.helpers import deliveries, make_call, row, wait_status
from tests.tasklog import TaskLog

SEND = "tools.send_email."


@pytest.fixture
def task_log():
    with TaskLog() as log:
        yield log


def outbox(tool_call_id: str) -> list[EmailOutbox]:
    with db.session() as s:
        return list(s.scalars(select(EmailOutbox).where(EmailOutbox.tool_call_id == tool_call_id)))


def history(tool_call_id: str) -> list[str]:
    return [e["status"] for e in row(tool_call_id).status_history]


def assert_no_link_failed(log: TaskLog, tool_call_id: str) -> None:
    """A stopped chain ends quietly: no link in FAILURE (or any state but SUCCESS/RETRY)."""
    states = {r.state for r in log.ran_for(tool_call_id)}
    assert states <= {"SUCCESS", "RETRY"}, log.ran_for(tool_call_id)


# -- send_email, end to end ------------------------------------------------------------

def test_send_email_checkpoint_resume_complete(worker, relay, task_log):
    call = make_call(callback_url=relay.url,
                     parameters={"to": "john@example.com", "subject": "Meeting Tomorrow", "body": "At 3pm."})
    id_ = call.tool_call_id
    confirmed = actions.confirm(id_).call
    assert confirmed.status == "EXECUTING" and confirmed.workflow_id

    preparing = relay.wait_for(id_, "progress")
    assert (preparing["step"], preparing["gate"], preparing["cancellable"]) == ("PREPARING", 1, True)
    assert preparing["status"] == "EXECUTING" and preparing["requires_confirmation"] is False
    assert preparing["message"] == "Preparing the email to john@example.com."
    assert preparing["actions_available"] == ["cancel"]

    checkpoint = relay.wait_for(id_, "checkpoint")
    assert (checkpoint["step"], checkpoint["gate"], checkpoint["status"]) == ("READY_TO_SEND", 2, "PREPARED")
    assert checkpoint["requires_confirmation"] is True and checkpoint["cancellable"] is True
    assert checkpoint["resume_url"].endswith(f"/voice-tools/resume/{id_}")
    assert checkpoint["preview"] == {"to": "john@example.com", "cc": [], "subject": "Meeting Tomorrow",
                                     "body": "At 3pm."}
    assert checkpoint["message"] == "The email to john@example.com is ready. Send it?"
    assert checkpoint["actions_available"] == ["proceed", "cancel"]

    prepared = wait_status(id_, "PREPARED")
    assert prepared.prepared_at is not None and prepared.current_step == "READY_TO_SEND"
    assert prepared.committed_at is None and outbox(id_) == []
    # PREPARING's link did the checkpoint (it has no work of its own: no link of its own is sent)
    # and ended the chain: its later links were never sent.
    task_log.wait_ran(id_, SEND + "PREPARING")
    assert task_log.published_for(id_, SEND + "READY_TO_SEND") == []
    assert task_log.published_for(id_, SEND + "SENDING") == []

    actions.resume(id_)
    completed = relay.wait_for(id_, "completed")
    sending = [e for e in relay.events_for(id_) if e["step"] == "SENDING"]
    assert [(e["event"], e["gate"], e["cancellable"]) for e in sending] == [("progress", 3, False)]
    done = row(id_)
    assert done.status == "COMPLETED"
    [sent] = outbox(id_)
    assert done.result == {"message_id": sent.message_id, "thread_id": sent.thread_id, "to": "john@example.com"}
    assert sent.headers["To"] == "john@example.com" and sent.body == "At 3pm."
    assert done.voice_response == "Email sent to john@example.com."
    assert done.completed_at is not None and done.committed_at is not None
    assert done.execution_time_ms is not None and done.execution_time_ms >= prepared.execution_time_ms
    assert history(id_) == ["PENDING", "EXECUTING", "PREPARED", "EXECUTING", "COMPLETED"]

    assert (completed["step"], completed["gate"], completed["status"]) == ("COMPLETED", 4, "COMPLETED")
    assert completed["result"] == done.result and completed["voice_response"] == done.voice_response
    assert completed["execution_time_ms"] == done.execution_time_ms and completed["progress"] == 1.0
    events = relay.events_for(id_)
    assert [(e["event"], e["step"]) for e in events] == [
        ("progress", "PREPARING"), ("checkpoint", "READY_TO_SEND"), ("progress", "SENDING"),
        ("completed", "COMPLETED")]
    assert [e["seq"] for e in events] == sorted({e["seq"] for e in events})
    # The relay saw the last event before the link recorded its answer: wait for the link to end.
    # SENDING's link completed the call (COMPLETED has no work of its own: no link of its own).
    task_log.wait_ran(id_, SEND + "SENDING")
    assert task_log.published_for(id_, SEND + "COMPLETED") == []
    assert all(d.state == "delivered" and d.attempts == 1 for d in deliveries(id_))
    assert relay.bad_signatures == 0
    assert_no_link_failed(task_log, id_)


def test_execution_time_excludes_the_checkpoint_wait(worker):
    call = make_call()
    actions.confirm(call.tool_call_id)
    prepared = wait_status(call.tool_call_id, "PREPARED")
    # As if the caller had taken an hour to say "send it".
    with db.session() as s:
        s.execute(text("UPDATE tool_calls SET confirmed_at = confirmed_at - interval '1 hour', "
                       "executed_at = executed_at - interval '1 hour', prepared_at = prepared_at - interval '1 hour' "
                       "WHERE tool_call_id = :id"), {"id": call.tool_call_id})
    actions.resume(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED"
    assert done.completed_at - done.confirmed_at > timedelta(hours=1)
    assert prepared.execution_time_ms <= done.execution_time_ms < 3_600_000


def test_cancel_at_the_checkpoint(worker, relay, task_log):
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    cancelled = actions.cancel(call.tool_call_id)
    assert cancelled.status == "CANCELLED" and cancelled.voice_response == "Cancelled. The email was not sent."
    event = relay.wait_for(call.tool_call_id, "cancelled")
    assert event["status"] == "CANCELLED" and event["voice_response"] == "Cancelled. The email was not sent."
    assert event["actions_available"] == [] and event["cancellable"] is False
    assert [d.event for d in deliveries(call.tool_call_id)] == ["progress", "checkpoint", "cancelled"]
    with pytest.raises(lifecycle.Refused) as info:
        actions.resume(call.tool_call_id)
    assert info.value.code == "already_terminal"
    # A stale SENDING message (e.g. redelivered) finds the call cancelled and does nothing.
    chains.LINKS["send_email"][2].apply_async((call.tool_call_id,))
    task_log.wait_ran(call.tool_call_id, SEND + "SENDING")
    assert outbox(call.tool_call_id) == []
    assert task_log.published_for(call.tool_call_id, SEND + "COMPLETED") == []
    assert row(call.tool_call_id).status == "CANCELLED"
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "PREPARED", "CANCELLED"]
    assert len(deliveries(call.tool_call_id, "cancelled")) == 1
    assert_no_link_failed(task_log, call.tool_call_id)


def test_redelivered_links_never_send_twice(worker, relay, task_log):
    call = make_call(callback_url=relay.url)
    id_ = call.tool_call_id
    actions.confirm(id_)
    wait_status(id_, "PREPARED")
    actions.resume(id_)
    # The rest of the chain delivered a second time, racing the first.
    chains.signature(tools.TOOLS["send_email"], id_, start=2).apply_async()
    task_log.wait_ran(id_, SEND + "SENDING", count=2)
    # The SENDING that sent completed the call itself (COMPLETED has no work of its own: no link of
    # its own is sent); the other found the send claimed, or recorded and the call completed.
    assert task_log.published_for(id_, SEND + "COMPLETED") == []
    done = wait_status(id_)
    assert done.status == "COMPLETED"
    assert len(outbox(id_)) == 1
    assert len(deliveries(id_, "completed")) == 1
    completed_at, seq = done.completed_at, done.event_seq

    # After completion, every link run again changes nothing. (A copy of SENDING that found the
    # send claimed by the other runs again when the claim's lease ends: its message has an eta and
    # the retries of the copy it is; it finds the call completed then.)
    for link in chains.LINKS["send_email"]:
        link.apply_async((id_,))
    for link in chains.LINKS["send_email"]:
        sent = [p for p in task_log.published_for(id_, link.name) if not (p.eta and p.retries == 0)]
        task_log.wait_ran(id_, link.name, count=len(sent))
    again = row(id_)
    assert (again.status, again.completed_at, again.event_seq, again.result) == (
        "COMPLETED", completed_at, seq, done.result)
    assert len(outbox(id_)) == 1
    assert len(deliveries(id_, "completed")) == 1
    relay.wait_for(id_, "completed")
    assert [e["event"] for e in relay.events_for(id_)].count("completed") == 1
    assert_no_link_failed(task_log, id_)


# -- query_vector_db ---------------------------------------------------------------------

def test_query_vector_db_stores_context(worker, relay):
    from voice_tools_backends import documents

    documents.load_demo()  # the embedded demo documents (no longer loaded by the first search)
    call = make_call("query_vector_db", {"user_query": "Q3 sales Northwest region"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    completed = relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED"
    assert set(done.result) == {"summary", "documents", "context_key"}
    assert done.result["context_key"] == "last_query_results" == done.context_key
    docs = done.result["documents"]
    assert docs and docs[0]["id"] == "q3-sales-northwest#0"
    for doc in docs:
        assert set(doc) == {"id", "title", "snippet", "score", "metadata"}
    assert done.result["summary"].startswith(f"{len(docs)} document")
    assert done.voice_response.endswith("It is available if you want to use it in an email.")

    with db.session() as s:
        stored = s.scalars(select(SessionContext).where(SessionContext.session_id == "sess_test")).one()
        assert s.scalar(select(func.count()).select_from(SessionContext)) == 1
    assert stored.context_key == "last_query_results"
    assert stored.context_value["documents"] == docs and stored.context_value["tool_call_id"] == call.tool_call_id
    assert timedelta(minutes=59) < stored.expires_at - stored.created_at <= timedelta(hours=1)

    assert completed["context_available"] is True and completed["context_key"] == "last_query_results"
    assert completed["result"] == done.result
    progress = [e for e in relay.events_for(call.tool_call_id) if e["event"] == "progress"]
    # once the context is stored the call has had its effect: no longer cancellable (its point of no return)
    assert [(e["step"], e["gate"], e["cancellable"]) for e in progress] == [
        ("QUERYING", 1, True), ("SEARCHING", 2, True), ("STORE_CONTEXT", 3, False)]
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "COMPLETED"]
    assert done.committed_at is not None


def test_a_relay_cannot_cancel_a_query_once_its_results_are_stored(worker, relay):
    """A cancel answered to the STORE_CONTEXT event comes after the effect: the call completes."""
    from voice_tools_backends import documents

    documents.load_demo()
    relay.answer(lambda event: {"cancel": True, "reason": "too late"} if event.get("step") == "STORE_CONTEXT" else None)
    call = make_call("query_vector_db", {"user_query": "Q3 sales Northwest region"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert (done.status, done.error_message) == ("COMPLETED", None)
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(SessionContext)) == 1
        with pytest.raises(lifecycle.Refused):
            lifecycle.cancel(s, call.tool_call_id)


# -- throwaway tools: cancellation windows, retries, failures ---------------------------------

class Thing(Schema):
    what = fields.String(required=True)


def make_tool(name: str, steps: tuple[Step, ...], max_retries: int = 5) -> Tool:
    return Tool(
        name=name, description="A tool made by a test.", schema=Thing, action_level="write", steps=steps,
        result=lambda outputs: {"outputs": dict(outputs)},
        confirmation_message="Do {what}?", start_message="Doing {what}.", modified_message="Now {what}?",
        voice_response="Did {what}.", failure_response="The {what} did not happen: {error}.",
        cancelled_response="Cancelled. The {what} did not happen.", max_retries=max_retries, time_limit=20,
    )


@pytest.fixture
def register(worker, celery_app_instance):
    """Register a test tool and have the running worker consume its queue."""
    app, registered = celery_app_instance, []

    def _register(tool: Tool) -> Tool:
        chains.register_tool(tool)
        registered.append(tool)
        # A running worker knows the tasks that existed when it started; teach it the new ones.
        worker.consumer.update_strategies()
        replies = app.control.add_consumer(tool.queue, reply=True, destination=[worker.hostname], timeout=10)
        assert replies, "the worker did not answer add_consumer"
        return tool

    yield _register
    for tool in registered:
        app.control.cancel_consumer(tool.queue, reply=True, destination=[worker.hostname], timeout=10)
        chains.unregister_tool(tool.name)


class Gate:
    """A step that blocks until the test opens it (so a cancel lands while it runs)."""

    def __init__(self, output=None):
        self.entered, self.release, self.runs, self.output = threading.Event(), threading.Event(), 0, output

    def __call__(self, step):
        self.runs += 1
        self.entered.set()
        assert self.release.wait(15), "gate never opened"
        return self.output


@pytest.fixture
def gates():
    made: list[Gate] = []

    def _gate(output=None) -> Gate:
        made.append(Gate(output))
        return made[-1]

    yield _gate
    for gate in made:  # never leave a worker thread blocked
        gate.release.set()


def test_cancel_while_a_step_runs_stops_the_chain_cleanly(register, gates, relay, task_log):
    slow, effect = gates({"draft": True}), gates({"done": True})
    effect.release.set()
    tool = register(make_tool("gated_a", (Step("DRAFT", run=slow), Step("APPLY", run=effect, side_effect=True),
                                          Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    assert slow.entered.wait(15)
    actions.cancel(call.tool_call_id, "Caller hung up")
    slow.release.set()
    task_log.wait_ran(call.tool_call_id, "tools.gated_a.DRAFT")
    relay.wait_for(call.tool_call_id, "cancelled")

    done = row(call.tool_call_id)
    assert done.status == "CANCELLED" and done.error_message == "Caller hung up"
    assert done.voice_response == "Cancelled. The transfer did not happen."
    # DRAFT (no side effect: its gate is a read, it claims nothing) ran once and recorded nothing
    assert slow.runs == 1 and done.step_outputs == {} and done.attempts == 0 and done.current_step is None
    assert effect.runs == 0
    assert task_log.published_for(call.tool_call_id, "tools.gated_a.APPLY") == []
    assert [d.event for d in deliveries(call.tool_call_id)] == ["cancelled"]
    assert_no_link_failed(task_log, call.tool_call_id)


def test_cancel_after_the_commit_point_is_too_late(register, gates, relay, task_log):
    effect = gates({"done": True})
    tool = register(make_tool("gated_b", (Step("APPLY", run=effect, side_effect=True), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    assert effect.entered.wait(15)
    with pytest.raises(lifecycle.Refused) as info:
        actions.cancel(call.tool_call_id)
    assert (info.value.code, info.value.status) == ("too_late", "EXECUTING")
    effect.release.set()
    relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and done.committed_at is not None and effect.runs == 1
    assert done.result == {"outputs": {"APPLY": {"done": True}}} and done.voice_response == "Did transfer."
    progress = relay.events_for(call.tool_call_id)[0]
    assert (progress["event"], progress["step"], progress["cancellable"]) == ("progress", "APPLY", False)
    assert deliveries(call.tool_call_id, "cancelled") == []


# -- a publish that reached the broker but whose answer was lost ---------------------------------

def test_a_resume_whose_publish_answer_was_lost_never_undoes_the_committed_call(
        register, gates, relay, client, lost_publish_answer, task_log):
    """The chain was published and its side effect committed before the API heard back: the undo
    meant for "the broker refused" must not move the call back to PREPARED (where it would wait
    for a proceed it already had, then expire saying "not done"); the API answers what is true."""
    effect = gates({"done": True})
    tool = register(make_tool("lost_resume", (Step("READY", checkpoint=True),
                                              Step("APPLY", run=effect, side_effect=True), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    lost_publish_answer(lambda: row(call.tool_call_id).committed_at is not None)

    answer = client.post(f"/voice-tools/resume/{call.tool_call_id}", headers=AUTH, json={"action": "proceed"})
    assert answer.status_code == 202, answer.get_json()
    assert answer.get_json()["status"] == "EXECUTING"
    running = row(call.tool_call_id)
    assert running.status == "EXECUTING" and running.committed_at is not None and effect.runs == 1
    effect.release.set()
    relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and done.voice_response == "Did transfer." and effect.runs == 1
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "PREPARED", "EXECUTING", "COMPLETED"]
    assert_no_link_failed(task_log, call.tool_call_id)


def test_a_confirm_whose_publish_answer_was_lost_answers_what_is_true(
        register, gates, relay, client, lost_publish_answer, task_log):
    """The first link has recorded its step when the publish "fails": there is nothing to undo, so the
    answer is not 503 "PENDING again" but the 202 of a started call, and the call finishes."""
    draft = gates({"draft": True})
    tool = register(make_tool("lost_confirm", (Step("LOOKUP", run=lambda step: {"found": True}),
                                               Step("DRAFT", run=draft),
                                               Step("APPLY", run=lambda step: {"done": True}, side_effect=True),
                                               Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    lost_publish_answer(lambda: row(call.tool_call_id).current_step is not None)

    answer = client.post(f"/voice-tools/confirm/{call.tool_call_id}", headers=AUTH)
    assert answer.status_code == 202, answer.get_json()
    assert answer.get_json()["status"] == "EXECUTING"
    assert row(call.tool_call_id).status == "EXECUTING"
    draft.release.set()
    relay.wait_for(call.tool_call_id, "completed")
    assert row(call.tool_call_id).status == "COMPLETED" and draft.runs == 1
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "COMPLETED"]
    assert_no_link_failed(task_log, call.tool_call_id)


def test_a_lost_publish_answer_while_a_first_read_step_runs_is_undone_and_its_run_records_nothing(
        register, gates, relay, client, lost_publish_answer, task_log):
    """A first link without side effect claims nothing (its gate is a read): while it runs and has
    recorded nothing, a lost publish answer puts the call back to PENDING (503); the run then records
    nothing (its chain is no longer the call's), and a confirm again runs the step again, harmlessly:
    one progress event of it, the same result."""
    draft = gates({"draft": True})
    tool = register(make_tool("lost_read", (Step("DRAFT", run=draft), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "lookup"}, callback_url=relay.url)
    lost_publish_answer(draft.entered.is_set)

    answer = client.post(f"/voice-tools/confirm/{call.tool_call_id}", headers=AUTH)
    assert answer.status_code == 503, answer.get_json()
    assert row(call.tool_call_id).status == "PENDING"
    draft.release.set()
    task_log.wait_ran(call.tool_call_id, "tools.lost_read.DRAFT")
    undone = row(call.tool_call_id)
    assert (undone.status, undone.step_outputs, undone.workflow_id) == ("PENDING", {}, None)
    assert deliveries(call.tool_call_id) == []

    again = client.post(f"/voice-tools/confirm/{call.tool_call_id}", headers=AUTH)
    assert again.status_code == 202, again.get_json()
    relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and draft.runs == 2
    assert done.result == {"outputs": {"DRAFT": {"draft": True}}}
    assert [(d.event, d.seq) for d in deliveries(call.tool_call_id)] == [("progress", 1), ("completed", 2)]
    assert_no_link_failed(task_log, call.tool_call_id)


@pytest.mark.slow
def test_transient_errors_retry_with_backoff_then_succeed(register, relay, task_log):
    tries = itertools.count(1)

    def flaky(step):
        n = next(tries)
        if n <= 2:
            raise TransientError(f"HTTP 503 on try {n}")
        return {"tries": n}

    tool = register(make_tool("flaky_a", (Step("FETCH", run=flaky), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "lookup"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and done.result == {"outputs": {"FETCH": {"tries": 3}}}
    assert done.attempts == 4  # FETCH three times, COMPLETED once
    fetches = task_log.published_for(call.tool_call_id, "tools.flaky_a.FETCH")
    assert [p.retries for p in fetches] == [0, 1, 2]
    assert fetches[0].eta is None and all(p.eta for p in fetches[1:])  # each retry waits
    assert all(p.queue == "tools.flaky_a" for p in fetches)
    # FETCH's link completes the call itself, and ends after the relay saw it: wait for its third run
    task_log.wait_ran(call.tool_call_id, "tools.flaky_a.FETCH", count=3)
    assert [r.state for r in task_log.ran_for(call.tool_call_id, "tools.flaky_a.FETCH")] == [
        "RETRY", "RETRY", "SUCCESS"]
    assert [e["event"] for e in relay.events_for(call.tool_call_id)] == ["progress", "completed"]


def test_permanent_error_fails_and_says_what_did_not_happen(register, relay, task_log):
    def broken(step):
        raise PermanentError("the account is closed")

    after = Step("AFTER", run=lambda step: pytest.fail("ran after a failure"))
    tool = register(make_tool("broken_a", (Step("CHARGE", run=broken), after, Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "payment"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed")
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and done.error_message == "the account is closed"
    assert done.voice_response == "The payment did not happen: the account is closed."
    assert done.completed_at is not None and done.execution_time_ms is not None
    assert (failed["step"], failed["gate"], failed["voice_response"]) == ("CHARGE", 1, done.voice_response)
    assert failed["status"] == "FAILED"
    task_log.wait_ran(call.tool_call_id, "tools.broken_a.CHARGE")
    assert len(task_log.published_for(call.tool_call_id, "tools.broken_a.CHARGE")) == 1  # no retry
    assert task_log.published_for(call.tool_call_id, "tools.broken_a.AFTER") == []
    assert_no_link_failed(task_log, call.tool_call_id)
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "FAILED"]


@pytest.mark.slow
def test_transient_errors_past_max_retries_fail(register, task_log):
    def down(step):
        raise TransientError("connection refused")

    tool = register(make_tool("down_a", (Step("FETCH", run=down), Step("COMPLETED")), max_retries=1))
    call = make_call(tool.name, {"what": "lookup"})
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED"
    assert done.error_message == "connection refused (gave up after 1 retries)"
    assert done.voice_response == "The lookup did not happen: connection refused (gave up after 1 retries)."
    assert [p.retries for p in task_log.published_for(call.tool_call_id)] == [0, 1]
    task_log.wait_ran(call.tool_call_id, "tools.down_a.FETCH", count=2)
    assert_no_link_failed(task_log, call.tool_call_id)


@pytest.mark.slow
@pytest.mark.parametrize("where, error, said, outcome", [
    ("APPLY", PermanentError("the bank refused it"), "The transfer did not happen: the bank refused it.", "not_done"),
    ("APPLY", TransientError("no answer"),
     "I could not confirm that the gated c request went through. Please check before trying again.", "unconfirmed"),
    ("AFTER", PermanentError("the receipt store is full"),
     "The gated c request went through, but a later step failed: the receipt store is full.", "done"),
])
def test_a_failure_at_or_after_the_point_of_no_return_never_says_it_did_not_happen(
        register, relay, task_log, where, error, said, outcome):
    """Refused by its service: not done. Unknown (no answer): unconfirmed. After the effect: done."""
    def fails(step):
        raise error

    steps = {"APPLY": {"applied": True}, "AFTER": {"filed": True}}
    runs = {name: (fails if name == where else (lambda step, out=out: out)) for name, out in steps.items()}
    tool = register(make_tool("gated_c", (Step("APPLY", run=runs["APPLY"], side_effect=True),
                                          Step("AFTER", run=runs["AFTER"]), Step("COMPLETED")), max_retries=0))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed")
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and done.committed_at is not None
    assert done.voice_response == failed["voice_response"] == said
    assert done.outcome == failed["outcome"] == outcome
    assert failed["step"] == where and failed["cancellable"] is False
    assert_no_link_failed(task_log, call.tool_call_id)


def test_an_unexpected_exception_fails_the_call(register, task_log):
    def buggy(step):
        return {}["missing"]

    tool = register(make_tool("buggy_a", (Step("FETCH", run=buggy), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "lookup"})
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED" and done.error_message == "Unexpected error in FETCH: KeyError"
    task_log.wait_ran(call.tool_call_id, "tools.buggy_a.FETCH")
    assert_no_link_failed(task_log, call.tool_call_id)


class ServiceAnswered(Exception):
    """What an HTTP client library raises for an error answer (as googleapiclient/openai do)."""

    def __init__(self, status_code: int):
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


@pytest.mark.slow
@pytest.mark.parametrize("error, transient", [
    (ServiceAnswered(429), True), (ServiceAnswered(503), True), (ServiceAnswered(400), False),
    (ConnectionRefusedError("refused"), True), (KeyError("x"), False),
])
def test_errors_from_client_libraries_are_classified(register, task_log, error, transient):
    tries = itertools.count(1)

    def once(step):
        if next(tries) == 1:
            raise error
        return {"ok": True}

    name = f"classified_{type(error).__name__.lower()}_{getattr(error, 'status_code', 0)}"
    tool = register(make_tool(name, (Step("FETCH", run=once), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "lookup"})
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == ("COMPLETED" if transient else "FAILED"), done.error_message
    runs = task_log.wait_ran(call.tool_call_id, f"tools.{name}.FETCH", count=2 if transient else 1)
    assert [r.state for r in runs] == (["RETRY", "SUCCESS"] if transient else ["SUCCESS"])
    assert_no_link_failed(task_log, call.tool_call_id)


def _embedded_postgres():
    from voice_tools import servers

    server = servers._started.get("postgres")
    if server is None:
        pytest.skip("the tests use a PostgreSQL they did not start (DATABASE_URL): not theirs to stop")
    return server


@pytest.mark.slow
def test_a_database_outage_mid_link_is_retried_and_the_call_ends_right(register, gates, relay, task_log):
    from embedded_postgres._commands import pg_ctl

    server = _embedded_postgres()
    slow = gates({"drafted": True})
    effect = gates({"sent": True})
    effect.release.set()
    tool = register(make_tool("outage_a", (Step("DRAFT", run=slow), Step("SEND", run=effect, side_effect=True),
                                           Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "delivery"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    assert slow.entered.wait(15)
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=30)
    try:
        slow.release.set()  # the step ends while the database is down: recording it fails
        # the first run ends in RETRY; while the database stays down a retry may fail again,
        # so more runs can be recorded by the time this thread wakes
        first = task_log.wait_ran(call.tool_call_id, "tools.outage_a.DRAFT", timeout=30)[0]
        assert first.state == "RETRY"  # Celery's autoretry took it, the call was not failed
    finally:
        server.ensure_postgres_running()

    relay.wait_for(call.tool_call_id, "completed", timeout=60)
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and effect.runs == 1
    assert done.result == {"outputs": {"DRAFT": {"drafted": True}, "SEND": {"sent": True}}}
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "COMPLETED"]
    assert_no_link_failed(task_log, call.tool_call_id)
