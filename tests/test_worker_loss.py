"""A worker dies in the middle of a link (docs/promises.md, "Surviving faults").

Real ``celery -A tasks worker --pool prefork -c 2 -Q tools.send_email`` subprocesses
(see ``support/worker_process.py``) run a send_email call; the test kills them with
SIGKILL while the SENDING link is inside its side effect, past the point of no
return, and shows that the link is delivered again, that the call ends COMPLETED and
that exactly one email was sent.

How the link is held mid-way, with no test hook in the product: before resuming, the
test inserts the call's ``email_outbox`` row in a transaction it keeps open. The
outbox's ``tool_call_id`` is unique, so the link's own INSERT (the send itself)
waits on that row's lock inside PostgreSQL: the link is then provably in the middle
of its side effect (``committed_at`` set, its INSERT listed as waiting on a lock in
``pg_stat_activity``) for as long as the test wants. The test rolls its row back when
it is done; the killed process's own INSERT can never commit (its client is gone).
The child running the link is found with Celery's remote control (``inspect active``
gives each running task's ``worker_pid``).

(a) one prefork child is SIGKILLed: ``task_acks_late`` + ``task_reject_on_worker_lost``
    requeue the message at once and another child runs the link;
(b) the whole worker (main process and children, its process group) is SIGKILLed:
    the message stays unacknowledged in Redis until the broker's visibility timeout
    (``VOICE_TOOLS_VISIBILITY_TIMEOUT``, 6 s here); a second worker started afterwards
    restores it and runs the link;
(c) the same, the worker killed while it held the restore sweep's lock in Redis (kombu's
    ``unacked_mutex``): no worker restores anything until the lock expires, so the lock
    must not outlive the visibility timeout by much (``celeryconfig.restore_lock_s``).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import psutil
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert

from celeryconfig import restore_lock_s
from models import db
from models.email import EmailOutbox
from tasks import app
from tasks.calls import actions
from tests.helpers import make_call, row, wait_status
from support.worker_process import WorkerProcess, queues_taken_from_others

pytestmark = pytest.mark.slow

QUEUE = "tools.send_email"
SENDING = "tools.send_email.SENDING"
VISIBILITY_TIMEOUT = 6
# PREPARING, READY_TO_SEND, SENDING, COMPLETED: four claims of a step; a redelivery adds one.
CLAIMS_WITHOUT_LOSS = 4


@contextmanager
def outbox_row_held(tool_call_id: str) -> Iterator[None]:
    """An uncommitted outbox row for the call: the SENDING link's INSERT waits on it."""
    with db.engine().connect() as conn:
        held = conn.begin()
        conn.execute(insert(EmailOutbox).values(
            tool_call_id=tool_call_id, message_id="<held-by-test>", thread_id="held", headers={}, body=""))
        try:
            yield
        finally:
            held.rollback()


def inserts_waiting() -> int:
    """Outbox INSERTs of other sessions waiting on a lock right now."""
    with db.engine().connect() as conn:
        return conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' "
            "AND query ILIKE 'INSERT INTO email_outbox%'"))


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def outbox_rows(tool_call_id: str) -> int:
    with db.session() as s:
        return s.scalar(select(func.count()).select_from(EmailOutbox).where(EmailOutbox.tool_call_id == tool_call_id))


def prepared_call(tag: str) -> str:
    call = make_call(parameters={"to": f"{tag}@example.com", "subject": f"Worker loss {tag}"},
                     session_id=f"sess_{tag}")
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED", timeout=60)
    return call.tool_call_id


def link_held_in_side_effect(worker: WorkerProcess, tool_call_id: str) -> dict:
    """Once resumed: wait until SENDING runs on ``worker`` and waits inside the send."""
    running = worker.wait_active(SENDING, [tool_call_id])
    wait_until(lambda: inserts_waiting() >= 1, "the SENDING link's INSERT to wait on the held row")
    held = row(tool_call_id)
    assert held.status == "EXECUTING" and held.current_step == "SENDING"
    assert held.committed_at is not None, "the link is past the point of no return"
    assert running["worker_pid"] in worker.children()
    return running


def assert_sent_once(tool_call_id: str) -> None:
    done = wait_status(tool_call_id, timeout=60)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    assert done.result["to"] == done.parameters["to"]
    assert outbox_rows(tool_call_id) == 1
    with db.session() as s:
        sent = s.scalars(select(EmailOutbox).where(EmailOutbox.tool_call_id == tool_call_id)).one()
    assert sent.message_id == done.result["message_id"] != "<held-by-test>"


@pytest.fixture
def own_queue():
    """The subprocess workers are the only consumers of tools.send_email."""
    with queues_taken_from_others(app, [QUEUE]):
        yield


@pytest.mark.slow
def test_prefork_child_killed_mid_link_is_redelivered_to_another_child(own_queue, tmp_path):
    with WorkerProcess(app, [QUEUE], pool="prefork", concurrency=2, log_dir=tmp_path, name="loss-child") as worker:
        tool_call_id = prepared_call("child")
        with outbox_row_held(tool_call_id):
            actions.resume(tool_call_id)
            first = link_held_in_side_effect(worker, tool_call_id)
            worker.kill_child(first["worker_pid"])
            # requeued at once (reject on worker lost), not after the visibility timeout
            again = worker.wait_active(SENDING, [tool_call_id], not_pid=first["worker_pid"], timeout=60)
            assert again["id"] == first["id"], "the same message, delivered again"
            assert not psutil.pid_exists(first["worker_pid"]) or \
                psutil.Process(first["worker_pid"]).status() == psutil.STATUS_ZOMBIE
        assert_sent_once(tool_call_id)
        assert row(tool_call_id).attempts == CLAIMS_WITHOUT_LOSS + 1, "SENDING claimed twice, everything else once"
        log = worker.log()
        assert "signal 9 (SIGKILL)" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("lock_left", [False, True], ids=["lock_free", "holding_the_restore_lock"])
def test_whole_worker_killed_mid_link_is_redelivered_after_visibility_timeout(own_queue, tmp_path, lock_left):
    env = {"VOICE_TOOLS_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT)}
    first_worker = WorkerProcess(app, [QUEUE], concurrency=2, log_dir=tmp_path, name="loss-first", env=env)
    second_worker = WorkerProcess(app, [QUEUE], concurrency=2, log_dir=tmp_path, name="loss-second", env=env)
    lock_s = restore_lock_s(VISIBILITY_TIMEOUT) if lock_left else 0
    try:
        first_worker.start()
        tool_call_id = prepared_call("whole")
        with outbox_row_held(tool_call_id):
            before_resume = time.time()
            actions.resume(tool_call_id)
            first = link_held_in_side_effect(first_worker, tool_call_id)
            family = [first_worker.pid, *first_worker.children()]
            first_worker.kill()
            assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                           for pid in family), "the whole worker is gone"
            assert row(tool_call_id).status == "EXECUTING"
            if lock_left:  # as the killed worker would have left it, mid-sweep: taken with its expiry
                with app.connection_for_write() as conn:
                    channel = conn.default_channel
                    assert channel.client.set(channel.unacked_mutex_key, "killed-worker", nx=True, px=lock_s * 1000)
                locked_at = time.time()

            second_worker.start()
            # a lock left behind holds the link back at most about one more visibility timeout
            again = second_worker.wait_active(SENDING, [tool_call_id], timeout=2 * VISIBILITY_TIMEOUT + 30)
            redelivered_by = time.time()
            assert again["id"] == first["id"], "the same message, restored from the unacked set"
        # Redis hid the unacknowledged message for the visibility timeout: the earliest
        # it can come back is the timeout after its first delivery (after before_resume).
        assert redelivered_by - before_resume >= VISIBILITY_TIMEOUT
        if lock_left:  # held back by the lock, and only until it expired
            assert redelivered_by - locked_at >= lock_s - 0.5
        assert_sent_once(tool_call_id)
        assert row(tool_call_id).attempts >= CLAIMS_WITHOUT_LOSS + 1
        assert f"{SENDING}[{first['id']}] received" in second_worker.log()
    finally:
        first_worker.stop()
        second_worker.stop()
