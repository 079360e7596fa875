"""Bounded tables: the retention purge (``celery -A tasks calls purge``, beat's ``maintenance.purge_old``)
removes ended calls past their retention with their events, settled events past theirs and expired
session context, in small batches; never an open call, never a pending event."""
from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from models import db, retention
from tasks import sweeps
from tasks.calls import maintenance
from tests.tasklog import TaskLog
from tests.test_cli import cli, cli_json

DAY = 86400
NOW = datetime.now(timezone.utc)
OPEN = ("PENDING", "MODIFIED", "EXECUTING", "PREPARED")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "EXPIRED")


def add_call(status: str, *, ended_days_ago: float | None, created_days_ago: float = 100.0,
             events: tuple[tuple[str, float], ...] = ()) -> str:
    """A call row as the lifecycle leaves it (``completed_at`` set when it ended), with its events:
    (state, days ago) each."""
    call_id = f"tc_{status.lower()}_{uuid.uuid4().hex[:10]}"
    created = NOW - timedelta(days=created_days_ago)
    completed = None if ended_days_ago is None else NOW - timedelta(days=ended_days_ago)
    with db.session() as s:
        s.execute(text(
            "INSERT INTO tool_calls (tool_call_id, session_id, function_name, action_level, status, created_at, "
            "completed_at, caller) VALUES (:id, 'sess_old', 'send_email', 'write', :status, :created, :completed, 'tests')"),
            {"id": call_id, "status": status, "created": created, "completed": completed})
        for seq, (state, days_ago) in enumerate(events, 1):
            s.execute(text(
                "INSERT INTO callback_deliveries (event_id, tool_call_id, event, seq, payload, url, session_id, state, "
                "created_at) VALUES (:eid, :id, 'completed', :seq, '{}'::jsonb, :url, 'sess_old', :state, :created)"),
                {"eid": uuid.uuid4().hex, "id": call_id, "seq": seq, "state": state,
                 "url": None if state == "none" else "http://127.0.0.1:9/cb", "created": NOW - timedelta(days=days_ago)})
    return call_id


def add_context(key: str, expires_in_s: float) -> None:
    with db.session() as s:
        s.execute(text("INSERT INTO session_context (session_id, context_key, context_value, caller, expires_at) "
                       "VALUES ('sess_old', :k, '{}'::jsonb, 'tests', now() + make_interval(secs => :e))"),
                  {"k": key, "e": expires_in_s})


def snapshot() -> dict[str, list]:
    """Every row of the three tables, by key."""
    with db.session() as s:
        return {
            "calls": sorted(s.scalars(text("SELECT tool_call_id FROM tool_calls"))),
            "events": sorted(s.execute(text("SELECT tool_call_id, seq, state FROM callback_deliveries")).all()),
            "context": sorted(s.scalars(text("SELECT context_key FROM session_context"))),
        }


def events_of(snap: dict[str, list], call_id: str) -> list:
    return [e for e in snap["events"] if e[0] == call_id]


@pytest.fixture
def world():
    """Old ended calls (each status; events delivered, failed, of no URL), an old ended call with an
    event still pending, recent ended calls with old and recent events, open calls created long ago
    (one with a stray ``completed_at``), context expired and not."""
    old = [add_call(status, ended_days_ago=31, events=(("delivered", 31), ("failed", 31), ("none", 31)))
           for status in ENDED]
    pending = add_call("COMPLETED", ended_days_ago=40, events=(("delivered", 40), ("pending", 40)))
    recent = add_call("COMPLETED", ended_days_ago=29, events=(("delivered", 45), ("none", 29), ("delivered", 1)))
    opened = [add_call(status, ended_days_ago=None, events=(("delivered", 90), ("none", 90))) for status in OPEN]
    stray = add_call("EXECUTING", ended_days_ago=90, events=(("delivered", 90),))
    add_context("expired_1", -10)
    add_context("expired_2", -86400 * 40)
    add_context("alive", 600)
    return {"old": old, "pending": pending, "recent": recent, "open": opened + [stray]}


def test_purge_removes_exactly_the_old_ended_calls_and_settled_events_and_dry_run_changes_nothing(world):
    before = snapshot()
    dry = cli_json("calls", "purge", "--older-than", "30d", "--dry-run")
    # 4 old calls x 3 events; the settled events past 30 days of calls kept: the recent call's
    # 45-day-old one and the 40-day-old delivered one of the call whose other event is pending
    assert (dry["calls"], dry["events"], dry["context"]) == (4, 4 * 3 + 2, 2), dry
    assert dry["dry_run"] is True and snapshot() == before  # nothing changed
    shown = cli("calls", "purge", "--older-than", "30d", "--dry-run")
    assert shown.exit_code == 0 and shown.output.startswith("Would remove 4 ended calls"), shown.output

    done = cli_json("calls", "purge", "--older-than", "30d", "--batch", "2")
    assert (done["calls"], done["events"], done["context"]) == (dry["calls"], dry["events"], dry["context"])
    # calls two at a time (2, 2, then none left), then the events (2, none), then the context (2, none)
    assert done["batches"] == 3 + 2 + 2
    after = snapshot()
    assert set(after["calls"]) == set(before["calls"]) - set(world["old"])
    for call_id in world["old"]:
        assert events_of(after, call_id) == []
    # the call whose event is still pending is kept, and its pending event
    assert world["pending"] in after["calls"]
    assert [e[2] for e in events_of(after, world["pending"])] == ["pending"]
    # the recent call stays; of its events only the one past 30 days went
    assert [e[1] for e in events_of(after, world["recent"])] == [2, 3]
    # open calls (however old) and their events are untouched
    for call_id in world["open"]:
        assert call_id in after["calls"] and events_of(after, call_id) == events_of(before, call_id)
    assert after["context"] == ["alive"]
    # a second purge finds nothing
    again = cli_json("calls", "purge", "--older-than", "30d")
    assert (again["calls"], again["events"], again["context"]) == (0, 0, 0)


def test_each_table_keeps_its_own_retention_and_zero_keeps_forever(world, monkeypatch):
    before = snapshot()
    monkeypatch.setenv("VOICE_TOOLS_RETAIN_CALLS_DAYS", "0")  # calls forever
    monkeypatch.setenv("VOICE_TOOLS_RETAIN_EVENTS_DAYS", "35")
    dry = cli_json("calls", "purge", "--dry-run")
    assert dry["retained_s"] == {"calls_s": None, "events_s": 35 * DAY}
    # only events past 35 days of ended calls: the pending call's delivered one, the recent call's 45-day one
    assert (dry["calls"], dry["events"]) == (0, 2), dry
    done = cli_json("calls", "purge")
    assert (done["calls"], done["events"], done["context"]) == (0, 2, 2)
    after = snapshot()
    assert after["calls"] == before["calls"]
    assert [e[2] for e in events_of(after, world["pending"])] == ["pending"]
    assert [e[1] for e in events_of(after, world["recent"])] == [2, 3]
    for call_id in world["old"] + world["open"]:
        assert events_of(after, call_id) == events_of(before, call_id)

    monkeypatch.setenv("VOICE_TOOLS_RETAIN_CALLS_DAYS", "30")
    monkeypatch.setenv("VOICE_TOOLS_RETAIN_EVENTS_DAYS", "0")  # events forever, but an old call takes its own
    done = cli_json("calls", "purge")
    assert (done["calls"], done["events"]) == (4, 12), done
    assert set(snapshot()["calls"]) == set(before["calls"]) - set(world["old"])


def test_the_purge_refuses_a_duration_that_is_not_one():
    for bad in ("0d", "thirty", "-1d"):
        result = cli("calls", "purge", "--older-than", bad)
        assert result.exit_code == 2 and "positive duration" in result.output, (bad, result.output)


def test_a_batch_skips_rows_another_transaction_holds_and_never_waits_for_them(world):
    """Small batches lock only their own rows: a call row held by another transaction is skipped
    (the purge does not wait for it), and removed by the next purge once it is free."""
    held = world["old"][0]
    conn = db.engine().connect()
    try:
        trans = conn.begin()
        conn.execute(text("SELECT 1 FROM tool_calls WHERE tool_call_id = :id FOR UPDATE"), {"id": held})
        result: list = []
        purging = threading.Thread(
            target=lambda: result.append(maintenance.purge(calls_s=30 * DAY, events_s=30 * DAY, batch=2)), daemon=True)
        purging.start()
        purging.join(10)
        waited = purging.is_alive()
        trans.rollback()  # lets a purge that waited for the row finish (and the test fail, not hang)
        purging.join(30)
        assert not waited, "the purge waited for a row another transaction held"
        assert result[0].calls == 3 and held in snapshot()["calls"]
    finally:
        conn.close()
    out = maintenance.purge(calls_s=30 * DAY, events_s=30 * DAY, batch=2)
    assert out.calls == 1 and held not in snapshot()["calls"]


def test_the_beat_sweep_purges_in_batches_on_the_worker(world, worker, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_PURGE_BATCH", "2")
    before = snapshot()
    with TaskLog() as log:
        sweeps.purge_old.apply_async()
        [ran] = log.wait_ran(None, "maintenance.purge_old", count=1)
    assert ran.state == "SUCCESS" and ran.retval == 4 + (4 * 3 + 2) + 2
    after = snapshot()
    assert set(after["calls"]) == set(before["calls"]) - set(world["old"])
    assert after["context"] == ["alive"]
    assert [e[2] for e in events_of(after, world["pending"])] == ["pending"]


def test_a_sweep_that_runs_out_of_time_stops_between_batches_and_the_next_goes_on(world):
    out = maintenance.purge(calls_s=30 * DAY, events_s=30 * DAY, batch=1, budget_s=0)
    assert (out.calls, out.batches, out.done) == (0, 0, False)
    rest = maintenance.purge(calls_s=30 * DAY, events_s=30 * DAY, batch=1)
    # one row a batch: 4 calls (and a last empty batch), 2 events (and one), 2 context values (and one)
    assert (rest.calls, rest.events, rest.context, rest.done) == (4, 14, 2, True) and rest.batches == 5 + 3 + 3


@pytest.fixture
def picks_run_again(monkeypatch):
    """This process's connections plan as PostgreSQL may when a table's statistics say it is small (a
    table that grew since its last ANALYZE): a nested loop whose inner side, a batch's pick, runs again
    for each row of the outer side. (``PGOPTIONS`` sets the planner's choices for the new connections.)"""
    def fresh_connections() -> None:
        db.engine().dispose()
        db.dispose()

    fresh_connections()
    monkeypatch.setenv("PGOPTIONS", " ".join(f"-c {choice}=off" for choice in (
        "enable_hashagg", "enable_sort", "enable_hashjoin", "enable_mergejoin", "enable_material")))
    yield
    monkeypatch.delenv("PGOPTIONS")
    fresh_connections()



def test_a_batch_removes_at_most_its_size_whatever_plan_postgresql_picks(world, picks_run_again):
    """A batch's pick (``LIMIT n … FOR UPDATE SKIP LOCKED``) is made once. Run again by a nested loop
    for each row, it would skip the rows the same statement had just removed and pick the next ones:
    one batch would remove every row met in the order of the pick, in one transaction."""
    with db.session() as s:
        assert s.execute(text("SHOW enable_material")).scalar_one() == "off"
    for key, expired_s in (("expired_a", 300), ("expired_b", 200), ("expired_c", 100)):
        add_context(key, -expired_s)  # stored in the order a batch picks them
    kept = add_call("COMPLETED", ended_days_ago=1, events=(("delivered", 50), ("delivered", 49), ("delivered", 48)))
    with db.session() as s:
        assert retention.purge_context(s, 1) == 1
    with db.session() as s:
        assert retention.purge_events(s, 30 * DAY, 1) == 1
    with db.session() as s:
        assert retention.purge_context(s, 2) == 2 and retention.purge_events(s, 30 * DAY, 2) == 2
    assert len(snapshot()["context"]) == 6 - 3  # the world's three and these three; three removed
    assert events_of(snapshot(), kept) == []  # the three oldest settled events were its own
