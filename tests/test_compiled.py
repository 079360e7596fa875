"""A hot statement run on the driver's cursor (``models/compiled.py``) gives what SQLAlchemy's own
execution gives: the same columns, values and types; the same errors; SQLAlchemy's path where the
compiled form cannot be reused, or where a cursor hook must see the statement."""
from __future__ import annotations

import pytest
from sqlalchemy import exc, select, text

from models import db, events, lifecycle, queries
from models.calls import ToolCall
from models import compiled
from models.compiled import Compiled
from tasks.delivery import attempts
from tasks.delivery.events import record
from tests.helpers import make_call

# set by the database at each statement (its clock, a new uuid): not comparable between two runs
VOLATILE = {"id", "status_history", "execution_time_ms", "delivery_event_id", "delivery_payload"}


def both_ways(statement: Compiled, params: dict) -> tuple[dict, dict]:
    """The statement's row by SQLAlchemy's execution, then by the compiled one, each in a savepoint
    rolled back (both see the same row before them)."""
    with db.session() as s:
        with s.begin_nested() as sp:
            by_sqlalchemy = s.execute(statement.stmt, params).one_or_none()
            sp.rollback()
        with s.begin_nested() as sp:
            by_cursor = statement.one_or_none(s, params)
            sp.rollback()
    assert by_sqlalchemy is not None and by_cursor is not None
    return dict(by_sqlalchemy._mapping), dict(by_cursor._mapping)


def assert_same(by_sqlalchemy: dict, by_cursor: dict) -> None:
    assert list(by_cursor) == list(by_sqlalchemy)
    for name, value in by_sqlalchemy.items():
        assert type(by_cursor[name]) is type(value), (name, by_cursor[name], value)
        if name not in VOLATILE:
            assert by_cursor[name] == value, name


def executing_call() -> str:
    call = make_call(callback_url="http://127.0.0.1:9/hook")
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
        lifecycle.record_step(s, call.tool_call_id, "PREPARING", {"draft": {"to": ["a@example.com"], "n": 1.5}}, 0.25)
    return call.tool_call_id


def test_a_gate_reads_the_row_sqlalchemy_reads():
    tool_call_id = executing_call()
    with db.statement() as s:
        assert lifecycle.gate(s, tool_call_id) is not None  # built
    assert_same(*both_ways(lifecycle._GATE[False], {"p_id": tool_call_id, "p_chain": None}))


def test_the_apis_reads_return_the_rows_sqlalchemy_returns():
    """status (one call, every column) and context (a session's open and ended calls, newest first)."""
    call = make_call(session_id="sess_compiled_reads", callback_url="http://127.0.0.1:9/hook")
    tool_call_id = call.tool_call_id
    ended = make_call(session_id=call.session_id)
    with db.session() as s:
        lifecycle.confirm(s, tool_call_id)
        lifecycle.record_step(s, tool_call_id, "PREPARING", {"draft": {"to": ["a@example.com"], "n": 1.5}}, 0.25)
        lifecycle.cancel(s, ended.tool_call_id, "no")
    for own in (False, True):
        assert_same(*both_ways(queries._GET[own], {"p_id": tool_call_id, "p_caller": call.caller}))
        statement = queries._session_calls(own)
        params = {"p_session": call.session_id, "p_limit": 10, "p_caller": call.caller}
        with db.session() as s:
            by_sqlalchemy = [dict(r._mapping) for r in s.execute(statement.stmt, params)]
        with db.statement() as s:
            by_cursor = [dict(r._mapping) for r in statement.all(s, params)]
        assert [r["tool_call_id"] for r in by_cursor] == [ended.tool_call_id, tool_call_id]
        assert len(by_cursor) == len(by_sqlalchemy)
        for mine, theirs in zip(by_cursor, by_sqlalchemy):
            assert_same(theirs, mine)
    with db.statement() as s:
        open_calls, recent = queries.session_calls(s, call.session_id, 10, caller=call.caller)
    assert ([c.tool_call_id for c in open_calls], [c.tool_call_id for c in recent]) == \
        ([tool_call_id], [ended.tool_call_id])


@pytest.mark.parametrize("attempt", [None, {"step": "SENDING", "started_at": "2026-01-01T00:00:00+00:00",
                                             "took_ms": 12.5, "outcome": "done", "reason": None}])
def test_a_step_record_with_its_event_returns_what_sqlalchemy_returns(attempt):
    tool_call_id = executing_call()
    event = events.event("progress", step="SENDING", gate=2, progress=0.5, message="Sending.", inline=True)
    with db.session() as s:
        with s.begin_nested() as sp:
            assert lifecycle.record_step(s, tool_call_id, "SENDING", {"id": "m1"}, 0.5, event=event,
                                         attempt=attempt) is not None
            sp.rollback()
    # in a session: not numbered
    built = lifecycle._BUILT[(("record_step", False, False, attempt is not None), event.shape, False)]
    params = {"p_id": tool_call_id, "p_step": "SENDING", "p_progress": 0.5, "p_output": {"id": "m1"},
              "p_chain": None, "p_token": None, "p_attempt": attempt, **event.params}
    by_sqlalchemy, by_cursor = both_ways(built, params)
    assert_same(by_sqlalchemy, by_cursor)
    assert by_cursor["delivery_payload"]["step"] == "SENDING" and by_cursor["step_outputs"]["SENDING"] == {"id": "m1"}
    assert {k: v for k, v in by_cursor["delivery_payload"].items() if k != "execution_time_ms"} == \
        {k: v for k, v in by_sqlalchemy["delivery_payload"].items() if k != "execution_time_ms"}


def create_params(tool_call_id: str) -> dict:
    return {"p_history": lifecycle._entry("PENDING", "Recorded"),
            **{f"c_{name}": None for name in lifecycle._CREATED_FROM},
            "c_tool_call_id": tool_call_id, "c_session_id": "s", "c_function_name": "send_email",
            "c_action_level": "write", "c_parameters": {"to": "a@example.com"}, "c_caller": "tests",
            "c_request_kind": "pending"}


def test_none_and_a_missing_parameter_are_bound_as_sqlalchemy_binds_them():
    """None for a JSONB parameter is what SQLAlchemy makes it (its processor sees None too), on disk alike."""
    with db.session() as s:
        s.execute(lifecycle._CREATE.stmt, create_params("tc_by_sqlalchemy"))
        lifecycle._CREATE.one_or_none(s, create_params("tc_by_cursor"))
        stored = dict(s.execute(text("SELECT tool_call_id, coalesce(jsonb_typeof(callback_urls), 'SQL NULL') "
                                     "FROM tool_calls WHERE tool_call_id LIKE 'tc_by_%'")).all())
        assert stored["tc_by_cursor"] == stored["tc_by_sqlalchemy"]
        with pytest.raises(KeyError, match="c_session_id"):
            lifecycle._CREATE.one_or_none(s, {k: v for k, v in create_params("tc_x").items() if k != "c_session_id"})


def test_a_created_call_is_the_row_sqlalchemy_creates():
    assert_same(*both_ways(lifecycle._CREATE, create_params("tc_compiled")))


def test_an_attempt_is_recorded_by_a_statement_without_rows():
    tool_call_id = executing_call()
    with db.session() as s:
        call = queries.get(s, tool_call_id)
        delivery = record(s, call, "progress", step="PREPARING", gate=1, message="m", inline=True)
    assert attempts._record_attempt(delivery.event_id, 0, 200, None, 5) == "delivered"
    with db.session() as s:
        state, tried = s.execute(text("SELECT state, attempts FROM callback_deliveries WHERE event_id = :e"),
                                 {"e": delivery.event_id}).one()
    assert (state, tried) == ("delivered", 1)


def test_a_lost_connection_is_sqlalchemys_error_and_the_pool_connects_again():
    tool_call_id = executing_call()
    with db.statement() as s:
        lifecycle.gate(s, tool_call_id)
        pid = s.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with db.engine().connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        with pytest.raises(exc.OperationalError) as lost:
            lifecycle.gate(s, tool_call_id)
        assert lost.value.connection_invalidated
    with db.statement() as s:  # a new connection
        assert lifecycle.gate(s, tool_call_id).tool_call_id == tool_call_id


def test_an_error_of_the_statement_is_sqlalchemys_error():
    broken = Compiled(select(ToolCall.tool_call_id).where(text("1 / 0 = 1")))
    with db.statement() as s, pytest.raises(exc.DataError):
        broken.one_or_none(s, {})


def test_an_expanding_list_goes_through_sqlalchemy():
    tool_call_id = executing_call()
    statement = Compiled(select(ToolCall.tool_call_id).where(ToolCall.status.in_(("EXECUTING", "PREPARED")),
                                                            ToolCall.tool_call_id == tool_call_id))
    with db.statement() as s:
        assert statement.one_or_none(s, {}).tool_call_id == tool_call_id
    assert list(statement._plans.values()) == [None]  # not reused: its SQL is finished at each execution


def test_a_cursor_hook_sees_the_statement():
    """A ``before_cursor_execute`` listener on the engine (here one that puts ``SET LOCAL
    synchronous_commit TO off`` in front of each statement) sees a compiled statement run there too."""
    from sqlalchemy import event

    def no_flush(conn, cursor, statement, parameters, context, executemany):
        return "SET LOCAL synchronous_commit TO off; " + statement, parameters

    setting = Compiled(select(text("current_setting('synchronous_commit') AS sync")))
    event.listen(db.engine(), "before_cursor_execute", no_flush, retval=True)
    try:
        with db.statement() as s:
            assert setting.one_or_none(s, {}).sync == "off"
    finally:
        event.remove(db.engine(), "before_cursor_execute", no_flush)
    with db.statement() as s:
        assert setting.one_or_none(s, {}).sync == "on"


def prepared_names(s) -> set[str]:
    return set(s.execute(text("SELECT name FROM pg_prepared_statements")).scalars())


def test_in_autocommit_a_statement_is_prepared_once_per_connection_and_returns_the_same_rows():
    tool_call_id = executing_call()
    with db.statement() as s:
        first = lifecycle.gate(s, tool_call_id)
        second = lifecycle.gate(s, tool_call_id)
        plan = lifecycle._GATE[False]._plans[s.dialect]
        assert plan.name in prepared_names(s)
        assert s.connection.info[compiled._PREPARED] >= {plan.name}
        created, _ = lifecycle.create(s, session_id="s", function_name="send_email", action_level="write",
                                      parameters={"to": "a@example.com"}, tool_call_id="tc_prepared", caller="tests")
        assert lifecycle._CREATE._plans[s.dialect].name in prepared_names(s)
    assert first == second
    with db.session() as s:  # not autocommit: as text, through the same compiled form
        assert dict(lifecycle.gate(s, tool_call_id)._mapping) == dict(first._mapping)
        by_sqlalchemy = dict(s.execute(lifecycle._CREATE.stmt, create_params("tc_text")).one()._mapping)
    assert_same({k: v for k, v in by_sqlalchemy.items() if k not in ("tool_call_id", "caller", "parameters", "created_at")},
                {k: v for k, v in dict(created._mapping).items() if k not in ("tool_call_id", "caller", "parameters", "created_at")})


def test_a_statement_not_found_on_the_connection_turns_preparing_off_and_still_runs(caplog):
    """As behind a pooler in transaction mode: the server connection is not the one the statement was
    prepared on. The statement runs as text, and nothing is prepared in this process any more."""
    tool_call_id = executing_call()
    with db.statement() as s:
        try:
            assert lifecycle.gate(s, tool_call_id) is not None
            s.execute(text("DEALLOCATE ALL"))  # what another server connection would look like
            assert lifecycle.gate(s, tool_call_id).tool_call_id == tool_call_id
            assert not compiled._preparing
            assert prepared_names(s) == set()
            assert lifecycle.gate(s, tool_call_id).tool_call_id == tool_call_id
            assert prepared_names(s) == set()
        finally:  # this connection as it is again for the tests after
            compiled._preparing = True
            s.connection.info.pop(compiled._PREPARED, None)
    assert "no longer prepared" in caplog.text


def test_a_statement_prepared_already_on_the_connection_is_used():
    """As behind a pooler, where another client prepared it on this server connection: same name, same
    statement (its name is a hash of its text and types), so it is executed and preparing stays on."""
    tool_call_id = executing_call()
    with db.statement() as s:
        assert lifecycle.gate(s, tool_call_id) is not None
        s.connection.info[compiled._PREPARED].clear()  # this client does not know it is there
        assert lifecycle.gate(s, tool_call_id).tool_call_id == tool_call_id
        assert compiled._preparing
        assert lifecycle._GATE[False]._plans[s.dialect].name in s.connection.info[compiled._PREPARED]


def test_rows_of_a_statement_are_sqlalchemys_rows():
    """``all()``: every row, in order, as SQLAlchemy's execution gives them (the calendar's busy periods)."""
    from datetime import datetime, timedelta, timezone

    from voice_tools_backends import calendar

    start = datetime(2031, 3, 3, 9, tzinfo=timezone.utc)
    with db.session() as s:
        for hour, owner in ((1, "tests"), (3, ""), (5, "another")):
            s.execute(text("INSERT INTO calendar_events (id, owner, title, starts_at, ends_at) "
                           "VALUES (:i, :o, :t, :s, :e)"),
                      {"i": f"ev{hour}", "o": owner, "t": f"t{hour}", "s": start + timedelta(hours=hour),
                       "e": start + timedelta(hours=hour, minutes=30)})
    params = {"b_caller": "tests", "b_start": start, "b_end": start + timedelta(hours=8)}
    with db.statement() as s:
        by_cursor = calendar._BUSY.all(s, params)
        by_sqlalchemy = s.execute(calendar._BUSY.stmt, params).all()
    assert [tuple(r) for r in by_cursor] == [tuple(r) for r in by_sqlalchemy] and len(by_cursor) == 2
    assert [r.title for r in by_cursor] == ["t1", "t3"]
    assert calendar.LocalCalendar().busy(start, start + timedelta(hours=8), "tests")[0]["title"] == "t1"



def test_each_hot_statement_is_named_by_what_it_does():
    """With tracing on a hot statement's span is named by its operation and table: a data-modifying CTE by
    the first row it changes (``UPDATE tool_calls``), never by its first word (``WITH``)."""
    import re

    from sqlalchemy.dialects.postgresql import psycopg2

    from tasks.delivery import delivered
    from models import trace_context as calls

    tool_call_id = executing_call()  # builds the transitions' statements of their shapes
    event = events.event("progress", step="SENDING", gate=2, progress=0.5, message="Sending.", inline=True)
    with db.session() as s:
        assert lifecycle.gate(s, tool_call_id) is not None
        assert lifecycle.record_step(s, tool_call_id, "SENDING", {"id": "m1"}, 0.5, event=event) is not None
    found: list[Compiled] = []
    for module in (queries, lifecycle, attempts, delivered, calls):
        for value in vars(module).values():
            found += [value] if isinstance(value, Compiled) else \
                [v for v in value.values() if isinstance(v, Compiled)] if isinstance(value, dict) else []
    dialect = psycopg2.dialect()
    plans = [plan for plan in (compiled._plan(each.stmt, dialect) for each in found) if plan is not None]
    assert len(plans) >= 8, len(plans)
    assert [plan.summary for plan in plans if not re.fullmatch(r"(SELECT|INSERT|UPDATE|DELETE) \w+", plan.summary)] == []
    assert [plan for plan in plans if plan.sql.lstrip().upper().startswith("WITH")], \
        "no data-modifying CTE among them: the test no longer shows what it is about"


def _change_type(column: str, to: str) -> None:
    """Another session changes a column's type, as a migration does under running processes."""
    with db.session() as other:
        other.execute(text(f"ALTER TABLE tool_calls ALTER COLUMN {column} TYPE {to}"))


def test_a_plan_refused_after_a_schema_change_is_prepared_again_and_run_once_more():
    """A returned column's type changed under a prepared statement: PostgreSQL refuses its plan
    (``cached plan must not change result type``) until it is prepared again. The statement is prepared
    again and run again on the same connection, in the same call: the caller sees its row."""
    tool_call_id = executing_call()
    with db.statement() as s:
        assert lifecycle.gate(s, tool_call_id) is not None
        plan = lifecycle._GATE[False]._plans[s.dialect]
        assert plan.name in prepared_names(s)
        try:
            _change_type("current_step", "varchar(51)")
            assert lifecycle.gate(s, tool_call_id).tool_call_id == tool_call_id
            assert compiled._preparing and plan.name in prepared_names(s)
        finally:
            _change_type("current_step", "varchar(50)")
        assert lifecycle.gate(s, tool_call_id).current_step == "PREPARING"  # and back again


def test_a_refused_plan_elsewhere_is_a_transient_database_error():
    """A plan PostgreSQL refuses after a schema change on SQLAlchemy's own path (a statement someone
    prepared by hand) is the error a lost connection is: retried by a link, a 503 in the API."""
    call = make_call()
    with db.statement() as s:
        s.exec_driver_sql("PREPARE by_hand AS SELECT current_step FROM tool_calls WHERE tool_call_id = $1")
        s.exec_driver_sql("EXECUTE by_hand(%(id)s)", {"id": call.tool_call_id})
        try:
            _change_type("current_step", "varchar(51)")
            with pytest.raises(exc.OperationalError) as raised:
                s.exec_driver_sql("EXECUTE by_hand(%(id)s)", {"id": call.tool_call_id})
            assert isinstance(raised.value, db.PlanRefused), type(raised.value)
        finally:
            s.exec_driver_sql("DEALLOCATE by_hand")
            _change_type("current_step", "varchar(50)")
