"""A link's delivered attempts are recorded by its process's recording thread, in batches
(``tasks/delivery/delivered.py``)."""
from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone

from sqlalchemy import update

from models import db
from models.calls import CallbackDelivery
from tasks.delivery import delivered
from tests.helpers import delivery, progress_event

URL = "http://127.0.0.1:9/tool-progress"  # no request is made here


def test_the_delivered_attempts_of_a_moment_are_recorded_by_one_statement(monkeypatch):
    """Ten attempts handed over 5 ms apart (a chain's links, other chains') are recorded together,
    each as it was: delivered, its code, its own time, its entry in the log, one attempt more.
    (The thread waits 0.5 s here, not 0.05, so that a busy machine's late wake-ups cannot split
    the batch.)"""
    event_ids = [progress_event(URL)[1] for _ in range(10)]
    monkeypatch.setattr(delivered, "LINGER_S", 0.5)
    recorder = delivered._Recorder()
    handed: dict[str, datetime] = {}
    for i, event_id in enumerate(event_ids):
        handed[event_id] = datetime.now(timezone.utc)
        recorder.put(delivered.attempt(event_id, 200 + i % 2, None))
        time.sleep(0.005)
    assert recorder.drain(5)
    assert recorder.batches == 1
    for i, event_id in enumerate(event_ids):
        row = delivery(event_id)
        assert (row.state, row.attempts, row.response_code, row.next_attempt_at, row.last_error) == \
            ("delivered", 1, 200 + i % 2, None, None)
        assert abs(row.delivered_at - handed[event_id]) < timedelta(seconds=0.5)
        [entry] = row.attempt_log
        assert entry["response_code"] == 200 + i % 2 and entry["error"] is None
        assert datetime.fromisoformat(entry["at"]) == row.delivered_at


def test_a_row_no_longer_pending_keeps_what_it_has():
    """An attempt recorded late does not overwrite a row that has moved on (an operator failed it,
    a retry delivered it): only pending rows take it."""
    _, moved_on = progress_event(URL)
    _, pending = progress_event(URL)
    with db.session() as s:
        s.execute(update(CallbackDelivery).where(CallbackDelivery.event_id == moved_on)
                  .values(state="failed", attempts=3, last_error="gone"))
    recorder = delivered._Recorder()
    recorder.put(delivered.attempt(moved_on, 200, None))
    recorder.put(delivered.attempt(pending, 200, "kept"))
    assert recorder.drain(5)
    assert (delivery(moved_on).state, delivery(moved_on).attempts, delivery(moved_on).last_error) == \
        ("failed", 3, "gone")
    row = delivery(pending)
    assert (row.state, row.attempts) == ("delivered", 1)
    assert row.attempt_log[0]["note"] == "kept"


def test_attempts_the_database_refuses_are_left_pending_for_the_retry_sweep(monkeypatch):
    """A batch the database will not take is tried again, then given up with a warning: its rows stay
    pending (due when the lease of their inline post ends, so the sweep posts them again); the thread
    goes on."""
    _, event_id = progress_event(URL)
    monkeypatch.setattr(delivered, "RETRY_S", 0.01)
    recorder = delivered._Recorder()
    broken = delivered._RECORD
    monkeypatch.setattr(delivered, "_RECORD", type("Refusing", (), {
        "execute": staticmethod(lambda s, params: (_ for _ in ()).throw(OSError("database away")))})())
    recorder.put(delivered.attempt(event_id, 200, None))
    assert recorder.drain(5)
    row = delivery(event_id)
    assert (row.state, row.attempts) == ("pending", 0)
    monkeypatch.setattr(delivered, "_RECORD", broken)
    recorder.put(delivered.attempt(event_id, 200, None))  # the thread is still there
    assert recorder.drain(5)
    assert delivery(event_id).state == "delivered"


def test_a_worker_without_pool_children_records_what_it_holds_when_it_stops(monkeypatch):
    """A worker whose links run in its own process (``--pool solo`` or ``threads``) gets no
    ``worker_process_shutdown``: its stopping (``worker_shutdown``) records the attempts its thread
    still holds, rather than leaving them to the retry sweep."""
    from celery.signals import worker_shutdown

    _, event_id = progress_event(URL)
    monkeypatch.setattr(delivered, "LINGER_S", 2.0)  # the batch is still waiting when the worker stops
    monkeypatch.setitem(delivered.recorder.made, os.getpid(), delivered._Recorder())
    delivered.record(event_id, 200)
    assert delivery(event_id).state == "pending"
    worker_shutdown.send(sender=None)
    row = delivery(event_id)
    assert (row.state, row.attempts, row.response_code) == ("delivered", 1, 200)
