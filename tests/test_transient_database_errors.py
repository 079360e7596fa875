"""A database error that is not the request's or the step's fault is transient: a 503 with
``Retry-After`` on every face (``tasks/calls/errors.py``), a retry with backoff in a task
(``tasks/base.py``: ``autoretry_for``), a retry in a step (``tasks.tools.is_transient``)."""
from __future__ import annotations

import pytest
from sqlalchemy import exc, text

from models import db
from tasks import base, tools
from tasks.calls import errors

# what PostgreSQL answers when it is not the statement's fault, raised by the server itself
TRANSIENT = {
    "serialization_failure": "40001",
    "deadlock_detected": "40P01",
    "lock_not_available": "55P03",
    "admin_shutdown": "57P01",
    "cannot_connect_now": "57P03",
    "too_many_connections": "53300",
}


@pytest.mark.parametrize("code", sorted(TRANSIENT.values()))
def test_the_servers_transient_errors_are_a_503_with_retry_after_and_retried(code):
    with pytest.raises(exc.DBAPIError) as raised:
        with db.statement() as s:
            s.execute(text(f"DO $$ BEGIN RAISE EXCEPTION 'transient' USING ERRCODE = '{code}'; END $$"))
    error = raised.value
    assert isinstance(error, base.Task.autoretry_for), type(error)
    assert tools.is_transient(error)
    answered = errors.api_error(error)
    assert answered is not None and answered.status == 503, answered
    assert answered.headers == {"Retry-After": str(errors.RETRY_AFTER_S)}


def test_a_connection_the_server_ended_is_a_503_with_retry_after():
    with db.statement() as victim:
        pid = victim.execute(text("SELECT pg_backend_pid()")).scalar()
        with db.session() as other:
            other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        with pytest.raises(exc.OperationalError) as raised:
            victim.execute(text("SELECT 1"))
    assert errors.api_error(raised.value).status == 503


def test_the_requests_own_fault_is_not_transient():
    with pytest.raises(exc.DBAPIError) as raised:
        with db.statement() as s:
            s.execute(text("SELECT 1/0"))
    assert not isinstance(raised.value, base.Task.autoretry_for)
    assert errors.api_error(raised.value) is None  # a 500, logged: our bug, not the database's state
