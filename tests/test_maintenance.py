"""Beat sweeps on the maintenance queue (docs/promises.md: expiry, stuck calls), run by the real worker."""
from __future__ import annotations

import logging
import time

import pytest
from sqlalchemy import func, select, text

from models import db, lifecycle, session_context
from models.calls import CallbackDelivery, SessionContext
from models.email import EmailOutbox
from celeryconfig import queue
from tasks import app, chains, liveness, tools
from tasks.calls import actions
from tasks.delivery import events
from tasks import sweeps
from tests.api_fixtures import CLOSED_PORT_BROKER, BrokerDown
from tests.helpers import counted, deliveries, make_call, row, wait_status
from tests.tasklog import TaskLog
from tests.test_worker_loss import inserts_waiting, outbox_row_held, wait_until
from support.worker_process import queues_taken_from_others


@pytest.fixture
def task_log():
    with TaskLog() as log:
        yield log


def sweep(task_log: TaskLog, task) -> int:
    """Run one beat task on the worker; return what it returned."""
    before = len([r for r in task_log.ran if r.name == task.name])
    task.apply_async()
    [*_, ran] = task_log.wait_ran(None, task.name, count=before + 1)
    assert ran.state == "SUCCESS"
    [published] = [p for p in task_log.published if p.name == task.name][before:]
    assert published.queue == "maintenance"
    return ran.retval


def backdate(tool_call_id: str, column: str, seconds: int) -> None:
    with db.session() as s:
        s.execute(text(f"UPDATE tool_calls SET {column} = {column} - make_interval(secs => :s) "
                       "WHERE tool_call_id = :id"), {"s": seconds, "id": tool_call_id})


def test_expire_stale_expires_pending_and_prepared_past_their_ttl(worker, relay, task_log, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_PENDING_TTL", "60")
    monkeypatch.setenv("VOICE_TOOLS_PREPARED_TTL", "30")
    stale_pending = make_call(callback_url=relay.url)
    fresh_pending = make_call(callback_url=relay.url)
    stale_prepared = make_call(callback_url=relay.url)
    fresh_prepared = make_call(callback_url=relay.url)
    for call in (stale_prepared, fresh_prepared):
        actions.confirm(call.tool_call_id)
        wait_status(call.tool_call_id, "PREPARED")
        relay.wait_for(call.tool_call_id, "checkpoint")
    backdate(stale_pending.tool_call_id, "created_at", 61)
    backdate(fresh_pending.tool_call_id, "created_at", 50)
    backdate(stale_prepared.tool_call_id, "prepared_at", 31)
    backdate(fresh_prepared.tool_call_id, "prepared_at", 20)
    expired_before = counted("voice_tools_calls_ended_total", tool="send_email", status="EXPIRED")

    assert sweep(task_log, sweeps.expire_stale) == 2
    for call in (stale_pending, stale_prepared):
        expired = row(call.tool_call_id)
        assert expired.status == "EXPIRED" and expired.error_message == "Expired unanswered"
        assert expired.completed_at is not None and expired.voice_response == "Expired. The email was not sent."
        assert expired.status_history[-1]["status"] == "EXPIRED"
        event = relay.wait_for(call.tool_call_id, "expired")
        assert event["status"] == "EXPIRED" and event["voice_response"] == "Expired. The email was not sent."
        assert event["actions_available"] == []
    assert row(fresh_pending.tool_call_id).status == "PENDING"
    assert row(fresh_prepared.tool_call_id).status == "PREPARED"
    with pytest.raises(lifecycle.Refused) as info:
        actions.resume(stale_prepared.tool_call_id)
    assert (info.value.code, info.value.status) == ("already_terminal", "EXPIRED")
    assert sweep(task_log, sweeps.expire_stale) == 0  # each call expires once
    with db.session() as s:
        assert s.scalar(select(func.count()).where(CallbackDelivery.event == "expired")) == 2
    assert counted("voice_tools_calls_ended_total", tool="send_email", status="EXPIRED") == expired_before + 2


def test_each_expiry_and_its_event_are_one_transaction_and_one_bad_call_does_not_stop_the_sweep(
        relay, monkeypatch):
    """Each call is expired with its event in one transaction: a call that cannot be (here a tool
    whose expired sentence raises for one call) is left as it was, never EXPIRED without its event
    and voice_response, and the next sweep tries again; the others are expired and announced."""
    from marshmallow import Schema, fields

    from tasks.tools import Step, Tool

    class Thing(Schema):
        what = fields.String(required=True)

    def cancelled(parameters, **_):
        if parameters["what"] == "poison":
            raise ValueError("this tool's sentence cannot say that")
        return f"Cancelled. The {parameters['what']} did not happen."

    tool = Tool(name="fragile_tool", description="A tool with a fragile sentence.", schema=Thing,
                action_level="write", steps=(Step("APPLY", side_effect=True), Step("COMPLETED")),
                result=lambda outputs: {}, confirmation_message="Do {what}?", start_message="Doing {what}.",
                modified_message="Now {what}?", voice_response="Did {what}.",
                failure_response="The {what} did not happen.", cancelled_response=cancelled)
    chains.register_tool(tool)
    try:
        monkeypatch.setenv("VOICE_TOOLS_PENDING_TTL", "60")
        bad = make_call(tool.name, {"what": "poison"}, callback_url=relay.url)
        good = [make_call(tool.name, {"what": f"transfer {i}"}, callback_url=relay.url) for i in range(2)]
        for call in (bad, *good):
            backdate(call.tool_call_id, "created_at", 61)

        assert sweeps.expire_stale() == 2
    finally:
        chains.unregister_tool(tool.name)
    for i, call in enumerate(good):
        expired = row(call.tool_call_id)
        assert expired.status == "EXPIRED" and expired.voice_response == f"Expired. The transfer {i} did not happen."
        [event] = [d for d in deliveries(call.tool_call_id) if d.event == "expired"]
        assert event.payload["status"] == "EXPIRED" and event.payload["voice_response"] == expired.voice_response
    untouched = row(bad.tool_call_id)
    assert untouched.status == "PENDING" and untouched.voice_response is None
    assert [h["status"] for h in untouched.status_history] == ["PENDING"]
    assert deliveries(bad.tool_call_id) == []


@pytest.mark.slow
def test_fail_stuck_fails_a_call_executing_with_no_progress(worker, relay, task_log):
    stuck, busy = make_call(callback_url=relay.url), make_call(callback_url=relay.url)
    with db.session() as s:  # confirmed, but their chains never ran (the worker died)
        for call in (stuck, busy):
            lifecycle.confirm(s, call.tool_call_id)
    limit = liveness.time_limit_s(tools.get("send_email"))
    backdate(stuck.tool_call_id, "confirmed_at", limit + 1)
    backdate(busy.tool_call_id, "confirmed_at", limit - 10)  # within its links' time limit

    assert sweep(task_log, sweeps.fail_stuck) == 1
    failed = row(stuck.tool_call_id)
    assert failed.status == "FAILED" and failed.error_message == "The worker stopped before finishing."
    assert failed.voice_response == "The email to john@example.com was not sent: The worker stopped before finishing."
    event = relay.wait_for(stuck.tool_call_id, "failed")
    assert event["voice_response"] == failed.voice_response and event["status"] == "FAILED"
    assert row(busy.tool_call_id).status == "EXECUTING"
    assert sweep(task_log, sweeps.fail_stuck) == 0


QUEUE = "tools.send_email"


def waiting(queue_name: str) -> int:
    """How many messages wait in ``queue_name`` in the broker (not delivered to any worker)."""
    with app.connection_for_read() as conn:
        return conn.default_channel.queue_declare(queue=queue_name, passive=True).message_count


@pytest.mark.slow
def test_fail_stuck_leaves_a_call_waiting_behind_a_backlog(worker, relay, task_log, caplog):
    """A call whose next link waits in its queue (a backlog: no worker takes it yet) is not
    stuck however long it waits; the log says why it is left alone."""
    call = make_call(callback_url=relay.url)
    with queues_taken_from_others(app, [QUEUE]):
        actions.confirm(call.tool_call_id)
        assert waiting(QUEUE) == 1, "its first link waits in the broker"
        assert liveness.read(app, [QUEUE]).seen[call.tool_call_id] == {"queued"}
        backdate(call.tool_call_id, "confirmed_at", 1000)  # past its time limit and the old 900 s quiet period

        assert sweep(task_log, sweeps.fail_stuck) == 0
        waits = row(call.tool_call_id)
        assert waits.status == "EXECUTING" and waits.error_message is None and waits.redrives == 0
        assert deliveries(call.tool_call_id) == []
        assert waiting(QUEUE) == 1
        with caplog.at_level(logging.INFO, logger="tasks.liveness"):
            assert liveness.stuck(app, 900) == []
        assert (f"{call.tool_call_id} (send_email at None) is quiet past its links' time limit and left alone: "
                f"its link is queued") in caplog.text
    prepared = wait_status(call.tool_call_id, "PREPARED")  # taken from the backlog at last, it runs
    assert prepared.current_step == "READY_TO_SEND"
    relay.wait_for(call.tool_call_id, "checkpoint")


@pytest.mark.slow
def test_fail_stuck_fails_a_call_whose_chain_was_lost_past_its_time_limit(worker, relay, task_log):
    """No message of the call anywhere (the broker lost it) and quiet past its links' time limit:
    stuck, long before the old 15-minute quiet period. A call as lost but still within its time
    limit is left (its first link may be on its way to the broker)."""
    lost, young = make_call(callback_url=relay.url), make_call(callback_url=relay.url)
    limit = liveness.time_limit_s(tools.get("send_email"))
    with queues_taken_from_others(app, [QUEUE]):
        for call in (lost, young):
            actions.confirm(call.tool_call_id)
        assert waiting(QUEUE) == 2
        with app.connection_for_write() as conn:  # the broker loses their links
            queue(QUEUE).bind(conn.default_channel).purge()
        backdate(lost.tool_call_id, "confirmed_at", limit + 1)
        backdate(young.tool_call_id, "confirmed_at", limit - 10)

        assert sweep(task_log, sweeps.fail_stuck) == 1
    failed = row(lost.tool_call_id)
    assert failed.status == "FAILED" and failed.error_message == "The worker stopped before finishing."
    assert failed.voice_response == "The email to john@example.com was not sent: The worker stopped before finishing."
    assert relay.wait_for(lost.tool_call_id, "failed")["status"] == "FAILED"
    assert row(young.tool_call_id).status == "EXECUTING"


@pytest.mark.slow
def test_fail_stuck_leaves_a_committed_call_whose_link_runs(worker, relay, task_log):
    """A link running on a worker (here held inside its send, past the point of no return) keeps
    its call alive past the old quiet period: it is not run a second time beside itself."""
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    with outbox_row_held(call.tool_call_id):
        actions.resume(call.tool_call_id)
        wait_until(lambda: inserts_waiting() >= 1, "the SENDING link's INSERT to wait on the held row")
        assert row(call.tool_call_id).committed_at is not None
        assert {"unacked", "active"} <= liveness.read(app, [QUEUE]).seen[call.tool_call_id]
        for column in ("confirmed_at", "executed_at", "resumed_at", "step_started_at"):
            backdate(call.tool_call_id, column, 1000)

        assert sweep(task_log, sweeps.fail_stuck) == 0
        running = row(call.tool_call_id)
        assert running.status == "EXECUTING" and running.redrives == 0
    relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and done.redrives == 0
    assert len(task_log.published_for(call.tool_call_id, "tools.send_email.SENDING")) == 1
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(EmailOutbox)) == 1


@pytest.mark.slow
def test_fail_stuck_leaves_a_call_whose_link_waits_for_its_eta(worker, relay, task_log):
    """A link published with a countdown (as a retry is) is held by a worker until its ETA: seen
    by ``inspect scheduled`` and, on Redis, in ``unacked``. Its call is alive."""
    call = make_call(callback_url=relay.url)
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
    held = chains.LINKS["send_email"][0].si(call.tool_call_id).apply_async(countdown=120)
    try:
        deadline = time.monotonic() + 15
        while "scheduled" not in liveness.read(app, [QUEUE]).seen.get(call.tool_call_id, ()):
            assert time.monotonic() < deadline, "the worker never held the link for its ETA"
        assert "unacked" in liveness.read(app, [QUEUE]).seen[call.tool_call_id]
        backdate(call.tool_call_id, "confirmed_at", 1000)

        assert sweep(task_log, sweeps.fail_stuck) == 0
        assert row(call.tool_call_id).status == "EXECUTING"
    finally:
        app.control.revoke(held.id)


@pytest.mark.slow
def test_the_facts_read_a_long_backlog_from_its_oldest_end_only(worker, monkeypatch):
    """Past ``SCAN_LIMIT`` waiting messages a queue is not copied whole: its oldest messages (where
    overdue calls wait) are read, and a call not seen there is "cannot tell", not "lost"."""
    monkeypatch.setattr(liveness, "SCAN_LIMIT", 1)
    with queues_taken_from_others(app, [QUEUE]):
        for _ in range(5):  # an earlier test's message (one Redis restored, unacknowledged) must not be the oldest
            older, newer = make_call(), make_call()
            with app.connection_for_write() as conn:
                conn.default_channel.queue_purge(QUEUE)
            for call in (older, newer):
                actions.confirm(call.tool_call_id)
            facts = liveness.read(app, [QUEUE])
            if not any("queued" in where for call_id, where in facts.seen.items()
                       if call_id not in (older.tool_call_id, newer.tool_call_id)):
                break
    assert facts.seen.get(older.tool_call_id) == {"queued"}
    assert facts.lost(older.tool_call_id, QUEUE) is False
    assert facts.lost(newer.tool_call_id, QUEUE) is None and QUEUE not in facts.complete


def test_fail_stuck_without_facts_waits_for_the_generous_bound(relay, monkeypatch):
    """The broker cannot be read: nothing says whether the call's link waits somewhere, so it is
    failed only once quiet past VOICE_TOOLS_STUCK_EXECUTING_AFTER."""
    monkeypatch.setenv("VOICE_TOOLS_STUCK_EXECUTING_AFTER", "600")
    call = make_call(callback_url=relay.url)
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
    backdate(call.tool_call_id, "confirmed_at", liveness.time_limit_s(tools.get("send_email")) + 1)
    monkeypatch.setenv("CELERY_BROKER_READ_URL", CLOSED_PORT_BROKER)  # BrokerDown points the writes only
    down = BrokerDown(app)
    try:
        assert sweeps.fail_stuck() == 0
        assert row(call.tool_call_id).status == "EXECUTING"
        backdate(call.tool_call_id, "confirmed_at", 600)
        assert sweeps.fail_stuck() == 1
    finally:
        down.restore()
    failed = row(call.tool_call_id)
    assert failed.status == "FAILED" and failed.error_message == "The worker stopped before finishing."
    assert relay.wait_for(call.tool_call_id, "failed")["status"] == "FAILED"


@pytest.mark.slow
def test_fail_stuck_judges_a_call_by_when_its_current_link_began(relay, monkeypatch):
    """docs/operations.md, VOICE_TOOLS_STUCK_EXECUTING_AFTER: a call is quiet from the moment its
    current link passed its gate, not from its first link. Here the first link ran long ago, the
    current one began just now, and the facts cannot tell (the broker cannot be read): the call
    is left until its current link has been quiet past the bound."""
    monkeypatch.setenv("VOICE_TOOLS_STUCK_EXECUTING_AFTER", "600")
    call = make_call(callback_url=relay.url)
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
        assert lifecycle.begin_step(s, call.tool_call_id, "PREPARING", 0.0) is not None  # the first link
    for column in ("confirmed_at", "executed_at"):
        backdate(call.tool_call_id, column, 1000)
    with db.session() as s:  # the current link (a later step) passes its gate now
        assert lifecycle.begin_step(s, call.tool_call_id, "SENDING", 0.5) is not None
    monkeypatch.setenv("CELERY_BROKER_READ_URL", CLOSED_PORT_BROKER)
    down = BrokerDown(app)
    try:
        assert sweeps.fail_stuck() == 0
        assert row(call.tool_call_id).status == "EXECUTING"
        backdate(call.tool_call_id, "step_started_at", 600)
        assert sweeps.fail_stuck() == 1
    finally:
        down.restore()
    assert row(call.tool_call_id).status == "FAILED"


@pytest.mark.slow
def test_fail_stuck_finishes_a_call_stuck_past_its_point_of_no_return(worker, relay, task_log):
    """Its email may have gone out: it is run again (idempotently), never told "not sent"."""
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    with db.session() as s:  # resumed, SENDING passed the commit point, then its worker died
        lifecycle.resume(s, call.tool_call_id)
        lifecycle.begin_step(s, call.tool_call_id, "SENDING", 0.5)
        lifecycle.commit_point(s, call.tool_call_id, "SENDING")
    for column in ("confirmed_at", "executed_at", "resumed_at", "step_started_at"):
        backdate(call.tool_call_id, column, 120)
    redrives_before = counted("voice_tools_redrives_total", tool="send_email")

    assert sweep(task_log, sweeps.fail_stuck) == 1
    relay.wait_for(call.tool_call_id, "completed")
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and done.voice_response == "Email sent to john@example.com."
    [redriven] = task_log.published_for(call.tool_call_id, "tools.send_email.SENDING")
    assert redriven.queue == "tools.send_email"
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(EmailOutbox)) == 1
    assert done.redrives == 1
    assert counted("voice_tools_redrives_total", tool="send_email") == redrives_before + 1
    assert [(h["status"], h["reason"]) for h in done.status_history][-2:] == [
        ("EXECUTING", lifecycle.REDRIVEN_REASON), ("COMPLETED", "Completed")]
    assert sweep(task_log, sweeps.fail_stuck) == 0


@pytest.mark.slow
def test_fail_stuck_gives_up_a_committed_call_after_its_redrives_saying_the_outcome_is_unconfirmed(
        worker, relay, task_log, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_MAX_REDRIVES", "2")
    call = make_call(callback_url=relay.url)
    with db.session() as s:  # past its point of no return, its chain already run again twice and lost again
        lifecycle.confirm(s, call.tool_call_id)
        lifecycle.begin_step(s, call.tool_call_id, "SENDING", 0.5)
        lifecycle.commit_point(s, call.tool_call_id, "SENDING")
        s.execute(text("UPDATE tool_calls SET redrives = 2 WHERE tool_call_id = :id"), {"id": call.tool_call_id})
    for column in ("confirmed_at", "executed_at", "step_started_at"):
        backdate(call.tool_call_id, column, 120)

    assert sweep(task_log, sweeps.fail_stuck) == 1
    failed = relay.wait_for(call.tool_call_id, "failed")
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and done.committed_at is not None and done.redrives == 2
    said = "I could not confirm that the email to john@example.com was sent. Please check your sent mail before trying again."
    assert done.voice_response == failed["voice_response"] == said
    assert "unconfirmed" in done.error_message
    assert task_log.published_for(call.tool_call_id, "tools.send_email.SENDING") == []
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(EmailOutbox)) == 0  # nothing was run again
    assert sweep(task_log, sweeps.fail_stuck) == 0


def test_retry_callbacks_resends_overdue_deliveries_only(worker, relay, task_log):
    call = make_call(callback_url=relay.url)
    with db.session() as s:
        confirmed = lifecycle.confirm(s, call.tool_call_id)
        overdue = events.record(s, confirmed, "progress", step="PREPARING", gate=1, message="a").event_id
        stepped = lifecycle.record_step(s, call.tool_call_id, "PREPARING", {}, 0.25)
        later = events.record(s, stepped, "progress", step="PREPARING", gate=1, message="b").event_id
    with db.session() as s:  # the first one's retry message was lost five minutes ago
        s.execute(text("UPDATE callback_deliveries SET next_attempt_at = now() - interval '5 minutes', attempts = 1 "
                       "WHERE event_id = :e"), {"e": overdue})
        s.execute(text("UPDATE callback_deliveries SET next_attempt_at = now() + interval '5 minutes', attempts = 1 "
                       "WHERE event_id = :e"), {"e": later})

    assert sweep(task_log, sweeps.retry_callbacks) == 1
    [resent] = task_log.published_for(overdue, "callbacks.deliver")
    assert resent.queue == "callbacks"
    task_log.wait_ran(overdue, "callbacks.deliver")
    assert [e["event_id"] for e in relay.events_for(call.tool_call_id)] == [overdue]
    with db.session() as s:
        states = dict(s.execute(select(CallbackDelivery.event_id, CallbackDelivery.state)).all())
    assert states == {overdue: "delivered", later: "pending"}
    assert task_log.published_for(later, "callbacks.deliver") == []
    assert sweep(task_log, sweeps.retry_callbacks) == 0


def test_retry_callbacks_sends_a_post_never_attempted_once_its_lease_has_passed(worker, relay, task_log):
    """An event inserted already claimed for its inline post (a lease ahead) whose post was never recorded (its
    worker died between the transition's commit and the post) is sent by the next sweep once the lease has
    passed, without the grace a retried delivery gets (whose retry message is due then); one whose inline post
    may still be running is not."""
    call = make_call(callback_url=relay.url)
    with db.session() as s:
        confirmed = lifecycle.confirm(s, call.tool_call_id)
        lost = events.record(s, confirmed, "progress", step="PREPARING", gate=1, message="a", inline=True).event_id
        stepped = lifecycle.record_step(s, call.tool_call_id, "PREPARING", {}, 0.25)
        running = events.record(s, stepped, "progress", step="PREPARING", gate=1, message="b", inline=True).event_id
        retried = events.record(s, stepped, "progress", step="PREPARING", gate=1, message="c").event_id
    with db.session() as s:  # the lost one's lease ended a second ago; the retried one's retry is due this second
        s.execute(text("UPDATE callback_deliveries SET next_attempt_at = now() - interval '1 second' "
                       "WHERE event_id = :e"), {"e": lost})
        s.execute(text("UPDATE callback_deliveries SET next_attempt_at = now() - interval '1 second', attempts = 1 "
                       "WHERE event_id = :e"), {"e": retried})

    assert sweep(task_log, sweeps.retry_callbacks) == 1
    task_log.wait_ran(lost, "callbacks.deliver")
    assert [e["event_id"] for e in relay.events_for(call.tool_call_id)] == [lost]
    assert task_log.published_for(running, "callbacks.deliver") == []
    assert task_log.published_for(retried, "callbacks.deliver") == []


def test_purge_context_deletes_only_expired_entries(worker, task_log):
    with db.session() as s:
        session_context.put_context(s, "sess_a", "last_query_results", {"n": 1}, 3600)
        session_context.put_context(s, "sess_b", "last_query_results", {"n": 2}, 3600)
        s.execute(text("UPDATE session_context SET expires_at = now() - interval '1 second' "
                       "WHERE session_id = 'sess_a'"))
    with db.session() as s:
        assert session_context.get_context(s, "sess_a", "last_query_results") is None  # expired reads as gone
    assert sweep(task_log, sweeps.purge_context) == 1
    with db.session() as s:
        assert s.scalars(select(SessionContext.session_id)).all() == ["sess_b"]
        assert session_context.get_context(s, "sess_b", "last_query_results").context_value == {"n": 2}
    assert sweep(task_log, sweeps.purge_context) == 0


@pytest.mark.slow
def test_fail_stuck_leaves_a_call_whose_link_began_while_the_sweep_judged_it(relay, monkeypatch):
    """The sweep judges a call quiet, then a link of it passes its gate (a copy of the same step)
    before the sweep's statement fails it: the statement checks the quiet period again, so the
    call is left to its running link. The link's gate is held in a transaction that has locked
    the call's row, so the sweep's statement reads the row only after the gate committed."""
    import threading

    monkeypatch.setenv("VOICE_TOOLS_STUCK_EXECUTING_AFTER", "600")
    call = make_call(callback_url=relay.url)
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
        assert lifecycle.begin_step(s, call.tool_call_id, "PREPARING", 0.0) is not None
    for column in ("confirmed_at", "executed_at", "step_started_at"):
        backdate(call.tool_call_id, column, 1000)
    monkeypatch.setenv("CELERY_BROKER_READ_URL", CLOSED_PORT_BROKER)
    down = BrokerDown(app)
    failed: list[int] = []
    try:
        with db.engine().connect() as gate:  # the link's gate, holding the call's row
            gate.execute(text("SELECT 1 FROM tool_calls WHERE tool_call_id = :id FOR UPDATE"),
                         {"id": call.tool_call_id})
            sweeping = threading.Thread(target=lambda: failed.append(sweeps.fail_stuck()))
            sweeping.start()
            deadline = time.monotonic() + 20
            while not _waits_on_a_lock(call.tool_call_id) and sweeping.is_alive():
                assert time.monotonic() < deadline, "the sweep never reached its statement"
                time.sleep(0.05)
            gate.execute(text("UPDATE tool_calls SET step_started_at = now() WHERE tool_call_id = :id"),
                         {"id": call.tool_call_id})
            gate.commit()
        sweeping.join(20)
    finally:
        down.restore()
    assert failed == [0], failed
    assert row(call.tool_call_id).status == "EXECUTING"


def _waits_on_a_lock(tool_call_id: str) -> bool:
    """Some session waits for a lock on a statement that names this call (the sweep's UPDATE)."""
    with db.engine().connect() as conn:
        return conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :q"),
            {"q": "UPDATE tool_calls%"}).scalar_one() > 0
