"""``?wait=S``: answers when the call is PREPARED or terminal (LISTEN/NOTIFY), 202 on timeout."""
from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import event

from models.listen import until_settled
from models import db, lifecycle
from tests.api_fixtures import created_id
from tests.conftest import AUTH
from tests.helpers import make_call, wait_status


def test_wait_wakes_on_the_status_notification():
    call = make_call()
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
    outcome: dict = {}
    waiter = threading.Thread(target=lambda: outcome.update(result=until_settled(call.tool_call_id, 20)))
    waiter.start()
    with db.session() as s:
        lifecycle.checkpoint(s, call.tool_call_id, "READY_TO_SEND", 0.25)
    waiter.join(25)
    settled_call, settled = outcome["result"]
    assert settled is True
    assert settled_call.status == "PREPARED"


def test_wait_ignores_other_calls_and_times_out():
    mine, other = make_call(), make_call()
    with db.session() as s:
        lifecycle.confirm(s, mine.tool_call_id)
        lifecycle.confirm(s, other.tool_call_id)
        lifecycle.checkpoint(s, other.tool_call_id, "READY_TO_SEND", 0.25)
    call, settled = until_settled(mine.tool_call_id, 0.3)
    assert settled is False and call.status == "EXECUTING"


def test_wait_on_a_call_already_settled_answers_at_once():
    call = make_call()
    with db.session() as s:
        lifecycle.cancel(s, call.tool_call_id)
    found, settled = until_settled(call.tool_call_id, 30)
    assert settled is True and found.status == "CANCELLED"


@pytest.mark.slow
def test_confirm_wait_times_out_with_202_and_current_status(client, worker, relay):
    # The relay holds the PREPARING progress callback for 1.5 s, so the checkpoint
    # cannot be reached within the 0.3 s wait.
    relay.delay = 1.5
    tool_call_id = created_id(client, callback_url=relay.url)
    answer = client.post(f"/voice-tools/confirm/{tool_call_id}?wait=0.3", headers=AUTH)
    assert answer.status_code == 202, answer.get_json()
    assert answer.get_json()["status"] == "EXECUTING"
    assert answer.get_json()["tool_call_id"] == tool_call_id
    assert answer.get_json()["message"] == "Preparing the email to test@example.com."
    assert wait_status(tool_call_id, "PREPARED").status == "PREPARED"


def test_confirm_wait_answers_the_full_record_at_the_checkpoint(client, worker, relay):
    tool_call_id = created_id(client, callback_url=relay.url)
    answer = client.post(f"/voice-tools/confirm/{tool_call_id}?wait=10", headers=AUTH)
    assert answer.status_code == 200
    record = answer.get_json()
    assert record["status"] == "PREPARED"
    assert record["actions_available"] == ["proceed", "cancel"]
    assert record["prepared_at"] and record["confirmed_at"]
    assert [h["status"] for h in record["status_history"]] == ["PENDING", "EXECUTING", "PREPARED"]


def test_resume_wait_answers_completed_with_result(client, worker):
    tool_call_id = created_id(client)
    assert client.post(f"/voice-tools/confirm/{tool_call_id}?wait=10", headers=AUTH).get_json()["status"] == "PREPARED"
    answer = client.post(f"/voice-tools/resume/{tool_call_id}?wait=10", headers=AUTH, json={"action": "proceed"})
    assert answer.status_code == 200
    record = answer.get_json()
    assert record["status"] == "COMPLETED"
    assert set(record["result"]) >= {"message_id", "thread_id", "to"}
    assert record["voice_response"] == "Email sent to test@example.com."
    assert record["committed_at"] is not None
    assert record["execution_time_ms"] is not None


def test_the_waiting_connection_goes_back_to_the_pool_listening_to_nothing():
    call = make_call()
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
    pool = db.engine().pool
    # the in-process worker shares this pool: count only this thread's checkouts and checkins
    mine, out, back = threading.get_ident(), [], []
    on_checkout = lambda dbapi, record, proxy: threading.get_ident() == mine and out.append(dbapi)  # noqa: E731
    on_checkin = lambda dbapi, record: threading.get_ident() == mine and back.append(dbapi)  # noqa: E731
    event.listen(pool, "checkout", on_checkout)
    event.listen(pool, "checkin", on_checkin)
    try:
        until_settled(call.tool_call_id, 0.2)
    finally:
        event.remove(pool, "checkout", on_checkout)
        event.remove(pool, "checkin", on_checkin)
    assert out and sorted(map(id, out)) == sorted(map(id, back)), "every connection it borrowed went back"
    borrowed = [db.engine().raw_connection() for _ in range(pool.checkedin())]
    try:
        for proxy in borrowed:
            with proxy.dbapi_connection.cursor() as cur:
                cur.execute("SELECT count(*) FROM pg_listening_channels()")
                assert cur.fetchone()[0] == 0
            assert proxy.dbapi_connection.autocommit is False
    finally:
        for proxy in borrowed:
            proxy.rollback()
            proxy.close()


@pytest.mark.slow
def test_waiting_holds_no_connection_between_reads():
    """Four waits on calls that do not move: each borrows a pooled connection to read the status,
    gives it back, and holds none while it waits (the process's listener wakes it)."""
    calls = [make_call() for _ in range(4)]
    with db.session() as s:
        for call in calls:
            lifecycle.confirm(s, call.tool_call_id)
    pool = db.engine().pool
    waiters: set[int] = set()
    held: dict[int, int] = {}
    lock = threading.Lock()

    def on_checkout(dbapi, record, proxy):
        with lock:
            if threading.get_ident() in waiters:
                held[threading.get_ident()] = held.get(threading.get_ident(), 0) + 1

    def on_checkin(dbapi, record):
        with lock:
            if threading.get_ident() in waiters:
                held[threading.get_ident()] -= 1

    def wait(tool_call_id: str) -> None:
        with lock:
            waiters.add(threading.get_ident())
        until_settled(tool_call_id, 3)

    event.listen(pool, "checkout", on_checkout)
    event.listen(pool, "checkin", on_checkin)
    try:
        threads = [threading.Thread(target=wait, args=(c.tool_call_id,)) for c in calls]
        for thread in threads:
            thread.start()
        samples = []
        for _ in range(10):
            time.sleep(0.1)
            with lock:
                samples.append(sum(held.values()))
        for thread in threads:
            thread.join(10)
    finally:
        event.remove(pool, "checkout", on_checkout)
        event.remove(pool, "checkin", on_checkin)
    assert len(held) == 4, held  # every wait read its call's status
    assert samples[-5:] == [0] * 5, samples  # and, waiting, held no connection


# -- over HTTP: a served API hands the wait to its stream loop (app/wait_answer.py) --------------------

def _pending_over_http(api_url: str, headers: dict[str, str], callback_url: str | None = None) -> str:
    import requests

    from tests.api_fixtures import GUIDE_EMAIL

    body = {"session_id": "sess_wait_http", "function": "send_email", "parameters": GUIDE_EMAIL}
    if callback_url:
        body["callback_url"] = callback_url
    created = requests.post(f"{api_url}/voice-tools/pending", headers=headers, json=body, timeout=10)
    assert created.status_code == 201, created.text
    return created.json()["tool_call_id"]


def test_a_wait_over_http_is_held_by_the_stream_loop_and_answers_the_record_at_the_checkpoint(api_url, worker,
                                                                                          relay):
    import requests
    from concurrent.futures import ThreadPoolExecutor

    from app import stream_loop

    relay.delay = 1.0  # the PREPARING callback is held: the wait is still held a moment later
    tool_call_id = _pending_over_http(api_url, AUTH, relay.url)
    before = stream_loop.held_waits()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(requests.post, f"{api_url}/voice-tools/confirm/{tool_call_id}?wait=20",
                              headers={**AUTH, "X-Request-ID": "wait-over-http"}, timeout=30)
        deadline = time.monotonic() + 10
        while stream_loop.held_waits() == before and not waiting.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stream_loop.held_waits() == before + 1  # held by the stream loop, not by a request's thread
        answer = waiting.result(timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "PREPARED" and answer.json()["actions_available"] == ["proceed", "cancel"]
    assert answer.headers["Content-Type"] == "application/json"
    assert answer.headers["X-Request-ID"] == "wait-over-http"
    assert answer.headers["Connection"] == "close"
    record = requests.get(f"{api_url}/voice-tools/status/{tool_call_id}", headers=AUTH, timeout=10)
    assert answer.content == record.content  # the same JSON, written as the view's would be
    deadline = time.monotonic() + 5
    while stream_loop.held_waits() > before and time.monotonic() < deadline:  # its task ends after the answer
        time.sleep(0.02)
    assert stream_loop.held_waits() == before


@pytest.mark.slow
def test_a_wait_over_http_that_ends_unsettled_answers_202_with_the_current_status(api_url, worker, relay):
    import requests

    relay.delay = 1.5
    tool_call_id = _pending_over_http(api_url, AUTH, relay.url)
    answer = requests.post(f"{api_url}/voice-tools/confirm/{tool_call_id}?wait=0.3", headers=AUTH, timeout=10)
    assert answer.status_code == 202, answer.text
    assert answer.json()["status"] == "EXECUTING" and answer.json()["tool_call_id"] == tool_call_id
    assert answer.json()["message"] == "Preparing the email to test@example.com."
    assert wait_status(tool_call_id, "PREPARED").status == "PREPARED"


def test_a_client_gone_while_it_waits_gives_its_slot_back(api_url, monkeypatch):
    """A caller whose open share is one wait: the client goes while its wait is held; the wait ends
    with it, and the caller's next long-held request is taken."""
    import json
    import os
    import socket
    import uuid

    import requests

    from app import stream_loop

    name, token = f"waits-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"{os.environ['VOICE_TOOLS_API_TOKENS']},{name}:{token}")
    monkeypatch.setenv("VOICE_TOOLS_CALLER_LIMITS", f"{name}::1")
    auth = {"Authorization": f"Bearer {token}"}
    key = uuid.uuid4().hex
    call = make_call(caller=name, idempotency_key=key, request_kind="execute")
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)  # EXECUTING, and nothing moves it on
    body = json.dumps({"session_id": call.session_id, "function": "send_email", "parameters": call.parameters,
                       "idempotency_key": key})  # a replay of the call: its record once it settles
    before = stream_loop.held_waits()
    port = int(api_url.rsplit(":", 1)[1])
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(f"POST /voice-tools/execute?wait=30 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    try:
        deadline = time.monotonic() + 10
        while stream_loop.held_waits() == before and time.monotonic() < deadline:
            time.sleep(0.02)
        if stream_loop.held_waits() == before:  # the body was refused before the wait: nothing held
            pytest.fail(client.recv(4096).decode(errors="replace"))
        refused = requests.get(f"{api_url}/voice-tools/events/sess_gone", headers=auth, timeout=10)
        assert refused.status_code == 429, refused.text
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while stream_loop.held_waits() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream_loop.held_waits() == before
    again = requests.get(f"{api_url}/voice-tools/events/sess_gone", headers=auth, stream=True, timeout=10)
    assert again.status_code == 200, again.text
    again.close()
