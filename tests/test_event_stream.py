"""GET /voice-tools/events/<session_id>: the session's events as Server-Sent Events (docs/relay-guide.md, The event stream).

The API runs in a real threaded HTTP server (the ``api_url`` fixture) so the stream is
read over HTTP as a relay would (``support/sse_client.py``); calls run on the in-process worker.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.api_fixtures import GUIDE_EMAIL
from tests.conftest import AUTH
from tests.helpers import deliveries, make_call, wait_status
from support.sse_client import Stream


def start_email(api_url: str, session_id: str) -> str:
    created = requests.post(f"{api_url}/voice-tools/pending", headers=AUTH, timeout=10,
                            json={"session_id": session_id, "function": "send_email", "parameters": GUIDE_EMAIL})
    assert created.status_code == 201, created.text
    tool_call_id = created.json()["tool_call_id"]
    assert requests.post(f"{api_url}/voice-tools/confirm/{tool_call_id}", headers=AUTH, timeout=10).status_code == 202
    return tool_call_id


def test_a_relay_with_no_callback_endpoint_follows_a_call_on_the_stream(api_url, worker):
    stream = Stream(f"{api_url}/voice-tools/events/sess_sse", AUTH)
    assert stream.response.status_code == 200
    assert stream.response.headers["Content-Type"].startswith("text/event-stream")
    tool_call_id = start_email(api_url, "sess_sse")
    progress = stream.next_event()
    checkpoint = stream.next_event()
    assert progress[1]["event"] == "progress" and progress[1]["step"] == "PREPARING"
    assert checkpoint[1]["event"] == "checkpoint" and checkpoint[1]["resume_webhook"]
    resumed = requests.post(checkpoint[1]["resume_webhook"].replace("http://127.0.0.1:8000", api_url),
                            headers=AUTH, json={"action": "proceed"}, timeout=10)
    assert resumed.status_code == 202, resumed.text
    rest = [stream.next_event() for _ in range(2)]
    stream.close()
    got = [progress, checkpoint, *rest]
    assert [e["event"] for _, e in got] == ["progress", "checkpoint", "progress", "completed"]
    assert stream.kinds == ["progress", "checkpoint", "progress", "completed"]  # `event: <kind>` per frame
    assert stream.retry == 2000  # the reconnect hint, sent first
    assert [e["seq"] for _, e in got] == [1, 2, 3, 4]
    rows = deliveries(tool_call_id)  # the same rows as the callbacks: recorded though no URL takes them
    assert [(r.event_id, r.state, r.url) for r in rows] == [(i, "none", None) for i, _ in got]
    assert got[-1][1]["voice_response"] == "Email sent to test@example.com."


def test_a_dropped_stream_resumes_with_last_event_id_with_no_loss_and_no_duplicate(api_url, worker):
    first = start_email(api_url, "sess_resume")
    wait_status(first, "PREPARED")
    stream = Stream(f"{api_url}/voice-tools/events/sess_resume", AUTH)
    seen = [stream.next_event()]
    stream.close()  # dropped after the first event

    second = start_email(api_url, "sess_resume")  # more happens while the relay is away
    wait_status(second, "PREPARED")
    requests.delete(f"{api_url}/voice-tools/cancel/{first}", headers=AUTH, timeout=10)
    wait_status(first, "CANCELLED")

    again = Stream(f"{api_url}/voice-tools/events/sess_resume", {**AUTH, "Last-Event-ID": seen[-1][0]})
    expected = len(deliveries(first)) + len(deliveries(second))
    seen += [again.next_event() for _ in range(expected - 1)]
    again.close()
    assert again.kinds == [e["event"] for _, e in seen[1:]]
    ids = [event_id for event_id, _ in seen]
    assert len(ids) == len(set(ids)) == expected
    assert set(ids) == {d.event_id for d in deliveries(first) + deliveries(second)}
    for call in (first, second):  # each call's events in seq order
        seqs = [e["seq"] for _, e in seen if e["tool_call_id"] == call]
        assert seqs == list(range(1, len(seqs) + 1))

    by_query = Stream(f"{api_url}/voice-tools/events/sess_resume?last_event_id={ids[-2]}", AUTH)
    assert by_query.next_event()[0] == ids[-1]
    by_query.close()


def test_unknown_last_event_id_is_422_and_the_token_is_needed(api_url):
    answer = requests.get(f"{api_url}/voice-tools/events/sess_x", headers={**AUTH, "Last-Event-ID": "nope"},
                          timeout=10)
    assert answer.status_code == 422 and "last_event_id" in answer.json()["details"]["fields"]
    assert requests.get(f"{api_url}/voice-tools/events/sess_x", timeout=10).status_code == 401
    assert requests.get(f"{api_url}/voice-tools/events/bad%20id", headers=AUTH, timeout=10).status_code == 422


def test_a_last_event_id_no_event_could_have_is_422_not_500(api_url):
    """Found by schemathesis: a NUL in ``last_event_id`` reached the database driver (500)."""
    for weird in ("\u36e6\u00d6\u00e3\u00f2\u00008", "x" * 500, "A" * 32):
        answer = requests.get(f"{api_url}/voice-tools/events/sess_x", params={"last_event_id": weird}, headers=AUTH,
                              timeout=10)
        assert answer.status_code == 422, (weird, answer.status_code, answer.text)
        assert answer.json()["details"]["fields"]["last_event_id"][0].startswith("No event "), answer.text


def test_an_idle_stream_sends_keep_alive_comments_and_holds_no_connection(api_url, monkeypatch):
    from app import stream
    from models import db

    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.2)
    checked_out_before = db.engine().pool.checkedout()
    gen = stream.stream("sess_idle", 0, keepalive_s=0.2)
    assert next(gen) == ": voice-tools event stream\nretry: 2000\n\n"
    assert next(gen) == ": keep-alive\n\n"  # nothing to send: a comment after the keep-alive interval
    assert db.engine().pool.checkedout() == checked_out_before  # idle: no connection held
    gen.close()


def test_a_stream_is_served_by_the_stream_loop_and_idle_holds_no_thread_and_no_connection(api_url, monkeypatch):
    """The server's socket is handed to the process's stream loop (app/stream_loop.py): the request's
    thread is free once the opening is written; idle, the stream holds no pooled connection and still
    sends its keep-alives."""
    from app import stream, stream_loop
    from models import db

    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.2)
    served_before = stream_loop.open_streams()
    checked_out_before = db.engine().pool.checkedout()
    idle = Stream(f"{api_url}/voice-tools/events/sess_loop", AUTH)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(idle.next_event)
            deadline = time.monotonic() + 5
            while len(idle.comments) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert idle.comments[1:3] == [": keep-alive", ": keep-alive"], idle.comments
            assert stream_loop.open_streams() == served_before + 1
            assert db.engine().pool.checkedout() == checked_out_before  # idle: no connection held
            event_id = record_progress("sess_loop")
            assert pending.result(timeout=5)[0] == event_id
    finally:
        idle.close()
    deadline = time.monotonic() + 5
    while stream_loop.open_streams() > served_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream_loop.open_streams() == served_before  # the client gone, the task ended


@pytest.fixture
def open_transaction_elsewhere():
    """A session idle in a transaction (one that holds a transaction id) in ANOTHER database of the
    same PostgreSQL server, as an unrelated application or a forgotten psql would leave it."""
    import os
    from urllib.parse import urlsplit, urlunsplit

    import psycopg2

    from voice_tools import servers

    parts = urlsplit(os.environ["DATABASE_URL"])
    servers.create_database(urlunsplit(parts._replace(path="/postgres")), "voice_tools_unrelated")
    conn = psycopg2.connect(urlunsplit(parts._replace(path="/voice_tools_unrelated")))
    with conn.cursor() as cur:
        cur.execute("SELECT pg_current_xact_id()")  # the transaction now holds an id, and stays open
    yield conn
    conn.rollback()
    conn.close()


def record_progress(session_id: str) -> str:
    """A new call of ``session_id`` and its first event, committed; the event's id."""
    return record_progress_of(make_call(session_id=session_id).tool_call_id)


def test_an_open_transaction_in_another_database_does_not_stall_the_stream(api_url, open_transaction_elsewhere):
    """docs/promises.md, Events and their order: no unrelated transaction delays the stream."""
    event_id = record_progress("sess_unrelated")  # recorded while the other database's transaction is open
    stream = Stream(f"{api_url}/voice-tools/events/sess_unrelated", AUTH)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(stream.next_event)
        try:
            got = first.result(timeout=3)
        finally:
            open_transaction_elsewhere.rollback()  # so a stalled reader ends either way
            stream.close()
    assert got[0] == event_id


@pytest.mark.slow
def test_a_stream_with_nothing_new_reads_no_more_often_than_its_keep_alive(api_url, open_transaction_elsewhere):
    """docs/operations.md, Event streams, waits and threads: woken by NOTIFY, not a polling loop,
    also while a transaction of another database is open."""
    from sqlalchemy import event

    from models import db

    reads = []

    def count(conn, cursor, statement, *args):
        if "FROM callback_deliveries" in statement and "session_id" in statement:
            reads.append(time.monotonic())

    record_progress("sess_quiet")
    event.listen(db.engine(), "before_cursor_execute", count)
    try:
        stream = Stream(f"{api_url}/voice-tools/events/sess_quiet", AUTH)
        time.sleep(2.0)  # nothing changes meanwhile
        open_transaction_elsewhere.rollback()
        stream.close()
    finally:
        event.remove(db.engine(), "before_cursor_execute", count)
    assert len(reads) <= 2, f"{len(reads)} reads in 2 s with nothing new (keep-alive 15 s)"


def test_an_event_that_commits_after_a_later_one_is_never_skipped(api_url):
    """docs/promises.md, Events and their order: an event recorded first but committed last comes
    after the ones a reader already has, live and on resume: no loss, no duplicate."""
    from sqlalchemy.orm import Session

    from models import db, events, lifecycle

    slow, quick = make_call(session_id="sess_late"), make_call(session_id="sess_late")
    stream = Stream(f"{api_url}/voice-tools/events/sess_late", AUTH)
    with Session(db.engine()) as open_one:
        lifecycle.record_event(open_one, slow.tool_call_id, events.event("progress", step="PREPARING", gate=1,
                                                                          progress=0.1))
        quick_id = record_progress_of(quick.tool_call_id)  # recorded later, committed first
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(stream.next_event).result(timeout=5)[0] == quick_id
        open_one.commit()
    slow_id = deliveries(slow.tool_call_id)[0].event_id
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(stream.next_event).result(timeout=5)[0] == slow_id
    stream.close()
    again = Stream(f"{api_url}/voice-tools/events/sess_late", {**AUTH, "Last-Event-ID": quick_id})
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(again.next_event).result(timeout=5)[0] == slow_id
    again.close()


def record_progress_of(tool_call_id: str) -> str:
    from models import events, lifecycle
    from models.db import session

    with session() as s:
        lifecycle.record_event(s, tool_call_id, events.event("progress", step="PREPARING", gate=1, progress=0.1))
    return deliveries(tool_call_id)[0].event_id


@pytest.mark.slow
def test_the_listener_hears_notify_when_its_process_has_more_than_1024_descriptors_open():
    """A process serving a thousand streams has a socket each open: the listener's connection, made (or
    made again after an outage) past descriptor 1024, must still be woken by NOTIFY, not only by its
    reconnect loop's wake-up every second."""
    import resource
    import socket

    from models import listen

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1300, hard), hard))
    held = [socket.socketpair() for _ in range(600)]  # 1,200 descriptors: the listener's comes after
    listener = listen.Listener()
    try:
        woken = listener.subscribe("sess_many_fds")
        time.sleep(1.5)  # connected (a first wake-up of everyone), then nothing: no wake-up
        woken.clear()
        time.sleep(1.5)
        assert not woken.is_set(), "woken with nothing new: the listener is not listening"
        record_progress("sess_many_fds")
        assert woken.wait(5), "NOTIFY did not wake the stream"
    finally:
        for a, b in held:
            a.close()
            b.close()


@pytest.mark.slow
def test_a_stream_cut_by_a_database_restart_ends_and_resumes_with_no_loss_and_no_duplicate(api_url):
    """The database goes away under an open stream: the stream loop ends the answer (the client sees its
    end, not a silent hang) and a reconnect with Last-Event-ID gets what it missed, once."""
    from sqlalchemy.exc import DBAPIError

    from support.system import restart_postgres

    first = record_progress("sess_restart")
    stream = Stream(f"{api_url}/voice-tools/events/sess_restart", AUTH)
    try:
        assert stream.next_event()[0] == first
        restart_postgres(down_s=1.0)
        with pytest.raises(AssertionError, match="stream ended"):
            stream.next_event()
    finally:
        stream.close()
    deadline = time.monotonic() + 20
    while True:  # the first use of each stale pooled connection fails once
        try:
            second = record_progress("sess_restart")
            break
        except DBAPIError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    again = None
    while again is None:
        candidate = Stream(f"{api_url}/voice-tools/events/sess_restart", {**AUTH, "Last-Event-ID": first})
        if candidate.response.status_code == 503 and time.monotonic() < deadline:
            candidate.close()
            time.sleep(0.2)
            continue
        again = candidate
    try:
        assert again.response.status_code == 200, again.response.text
        assert again.next_event()[0] == second
        third = record_progress("sess_restart")
        assert again.next_event()[0] == third  # live again: the listener is back
    finally:
        again.close()


class Reads:
    """Counts the stream's reads of the events table in this process (the test API's stream loop)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> "Reads":
        from sqlalchemy import event

        from models import db

        event.listen(db.engine(), "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        from sqlalchemy import event

        from models import db

        event.remove(db.engine(), "before_cursor_execute", self._seen)

    def _seen(self, conn, cursor, statement, *args) -> None:
        if "FROM callback_deliveries" in statement and "commit_seq >" in statement:
            self.count += 1


def next_event_within(stream: Stream, seconds: float = 5) -> tuple[str, dict]:
    from concurrent.futures import TimeoutError as NoAnswer

    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(stream.next_event).result(timeout=seconds)
    except NoAnswer:
        stream.close()  # the reading thread's next read fails, so it ends
        raise AssertionError(f"no event within {seconds} s") from None
    finally:
        pool.shutdown(wait=False)


def caught_up(stream: Stream, session_id: str) -> str:
    """Returns once ``stream`` has made every read of the table it was due so far: the process's listener
    is connected (its connection woke every stream to read, before any notification), and an event recorded
    now has reached the stream (every read asked before it is done); that event's id. A read counted
    after this is one the test caused, however late the stream's own reads ran on a busy machine."""
    from sqlalchemy import text

    from models import db, listen

    probe_key = f"{session_id}_listening"
    probe = listen.LISTENER.subscribe(probe_key)  # set by a notice of probe_key, or by the listener's connecting
    try:
        deadline = time.monotonic() + 20
        while not probe.is_set():
            assert time.monotonic() < deadline, "the listener did not connect"
            with db.engine().connect() as conn:
                conn.execute(text("SELECT pg_notify(:channel, :key)"),
                             {"channel": listen.EVENTS_CHANNEL, "key": probe_key})
                conn.commit()
            probe.wait(0.2)
    finally:
        listen.LISTENER.unsubscribe(probe_key, probe)
    event_id = record_progress(session_id)
    assert next_event_within(stream)[0] == event_id
    return event_id


def test_a_live_event_is_written_from_its_notification_with_no_read_of_the_table(api_url):
    """A stream that is caught up writes a new event from its NOTIFY (which carries it), exactly as a
    read of its row would give it, and reads nothing."""
    first = record_progress("sess_notice")
    stream = Stream(f"{api_url}/voice-tools/events/sess_notice", AUTH)
    try:
        assert next_event_within(stream)[0] == first  # what was there: read from the table
        caught_up(stream, "sess_notice")
        with Reads() as reads:
            second = record_progress("sess_notice")
            event_id, payload = next_event_within(stream)
        assert event_id == second
        assert payload == deliveries_by_event(second).payload
        assert reads.count == 0, f"{reads.count} reads of the events table for an event its NOTIFY carried"
    finally:
        stream.close()


def test_an_event_too_large_for_a_notification_is_read_from_the_table_in_its_place(api_url):
    """PostgreSQL takes a notification of less than 8000 bytes: a larger event's NOTIFY says only its
    number, and the stream reads it, in its order between the events around it.

    The stream's own first read of the table may run at any moment until it is caught up: reads are
    counted only after that, so that read is never taken for the large event's."""
    from models import events, lifecycle
    from models.db import session

    stream = Stream(f"{api_url}/voice-tools/events/sess_large", AUTH)
    try:
        caught_up(stream, "sess_large")
        call = make_call(session_id="sess_large")
        with Reads() as reads:
            with session() as s:
                lifecycle.record_event(s, call.tool_call_id, events.event(
                    "progress", step="PREPARING", gate=1, progress=0.1, message="Almost there. " * 700))
            small = record_progress("sess_large")
            got = [next_event_within(stream), next_event_within(stream)]
        large = deliveries(call.tool_call_id)[0]
        assert [event_id for event_id, _ in got] == [large.event_id, small]
        assert got[0][1] == large.payload and len(got[0][1]["message"]) == len("Almost there. " * 700)
        assert reads.count >= 1
    finally:
        stream.close()


def test_a_live_event_of_another_callers_call_in_the_same_session_is_not_sent(api_url):
    """The notification carries the call's caller: a stream of one caller skips another's events."""
    stream = Stream(f"{api_url}/voice-tools/events/sess_notice_shared", AUTH)
    try:
        record_progress_of(make_call(session_id="sess_notice_shared", caller="someone-else").tool_call_id)
        ours = record_progress("sess_notice_shared")
        assert next_event_within(stream)[0] == ours
    finally:
        stream.close()


def deliveries_by_event(event_id: str):
    from sqlalchemy import select

    from models.calls import CallbackDelivery
    from models.db import session

    with session() as s:
        return s.execute(select(CallbackDelivery).where(CallbackDelivery.event_id == event_id)).scalar_one()


def test_a_stream_whose_inbox_overflows_reads_the_table_and_misses_nothing():
    """A stream more than 200 notices behind (a slow client) drops them and reads the table from its last
    event: every event once, in order."""
    import asyncio

    from models import events, lifecycle, listen
    from models.db import session

    first = record_progress("sess_overflow")
    calls = [make_call(session_id="sess_overflow") for _ in range(3)]
    listen.LISTENER.loop()
    time.sleep(1.0)  # the listener connected: its first wake of everyone is behind us

    async def follow() -> tuple[list[str], int]:
        stream = listen.session_events_async("sess_overflow", 0, 30.0)
        got = [(await stream.__anext__()).event_id]
        with session() as s:  # 3 x 90 events in one transaction: 270 notices at once
            for call in calls:
                for k in range(90):
                    lifecycle.record_event(s, call.tool_call_id, events.event(
                        "progress", step="PREPARING", gate=1, progress=k / 100))
        await asyncio.sleep(1.0)  # the notices pile up unread
        with Reads() as reads:
            while len(got) < 271:
                got.append((await asyncio.wait_for(stream.__anext__(), 5)).event_id)
        await stream.aclose()
        return got, reads.count

    got, reads = asyncio.run(follow())
    from sqlalchemy import text

    from models import db

    with db.engine().connect() as conn:
        want = conn.execute(text("SELECT event_id FROM callback_deliveries WHERE session_id = 'sess_overflow' "
                                 "ORDER BY commit_seq")).scalars().all()
    assert got == want and got[0] == first
    assert reads >= 1  # what the inbox dropped came from the table


def test_a_waiting_stream_is_written_by_the_listener_itself_in_order():
    """On the listener's own loop (the API's streams), a stream that waits with nothing queued is given each
    new notice by the listener's callback itself (its ``direct`` writer), and does not yield it again; a
    notice the writer declines is queued and yielded by the stream, and so is every one behind it: each
    event once, in order."""
    import asyncio

    from models import listen

    first = record_progress("sess_direct")
    loop = listen.LISTENER.loop()
    time.sleep(1.0)  # the listener connected: its first wake of everyone is behind us
    taken: list[str] = []

    def direct(notice: listen.Notice) -> bool:
        assert asyncio.get_running_loop() is loop  # from the listener's callback, on its loop
        if len(taken) == 2:
            return False  # a client that has not taken what it was sent: the stream writes the rest
        taken.append(notice.event_id)
        return True

    async def follow() -> tuple[list[str], list[str]]:
        stream = listen.session_events_async("sess_direct", 0, 30.0, None, direct)
        got: list[str] = []

        async def read() -> None:  # as a stream's task: it asks for the next event as soon as it has one
            async for event in stream:
                if event is not None:
                    got.append(event.event_id)

        reading = asyncio.ensure_future(read())
        while not got:  # the table's read
            await asyncio.sleep(0.05)
        recorded = [await loop.run_in_executor(None, record_progress, "sess_direct") for _ in range(4)]
        deadline = time.monotonic() + 5
        while len(taken) + len(got) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # nothing more comes
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await stream.aclose()
        return got, recorded

    got, recorded = asyncio.run_coroutine_threadsafe(follow(), loop).result(timeout=30)
    assert got[0] == first
    assert taken == recorded[:2] and got[1:] == recorded[2:]


@pytest.mark.slow
def test_the_listener_hears_notify_after_two_database_restarts_in_a_row():
    """Each outage closes the listening connection, often after libpq has closed its socket itself; the
    connection made after it (likely on the same descriptor number) must be listened to again, and so
    must the one made after a second outage."""
    from support.system import restart_postgres

    from models import listen

    listener = listen.Listener()
    woken = listener.subscribe("sess_two_restarts")
    time.sleep(1.0)  # connected
    for _ in range(2):
        restart_postgres(down_s=0.5)
        deadline = time.monotonic() + 20
        while True:  # until the database answers again and the listener is back (it wakes everyone then)
            woken.clear()
            if woken.wait(1.0):
                time.sleep(1.5)  # a wake of the reconnect loop, or of the new connection: let it settle
                break
            assert time.monotonic() < deadline, "the listener never came back"
    deadline = time.monotonic() + 20
    while True:
        try:
            woken.clear()
            record_progress("sess_two_restarts")
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.3)
    assert woken.wait(5), "NOTIFY did not wake the stream after two restarts"


def _streams_open_on_the_metrics_page(api_url: str) -> float:
    page = requests.get(f"{api_url}/metrics", headers=AUTH, timeout=10).text
    [value] = [line.split()[-1] for line in page.splitlines() if line.startswith("voice_tools_event_streams_open ")]
    return float(value)


def test_the_metrics_page_counts_the_event_streams_open(api_url):
    before = _streams_open_on_the_metrics_page(api_url)
    streams = [Stream(f"{api_url}/voice-tools/events/sess_gauge_{n}", AUTH) for n in range(2)]
    try:
        deadline = time.monotonic() + 5
        while _streams_open_on_the_metrics_page(api_url) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _streams_open_on_the_metrics_page(api_url) == before + 2
    finally:
        for stream in streams:
            stream.close()
    deadline = time.monotonic() + 5
    while _streams_open_on_the_metrics_page(api_url) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _streams_open_on_the_metrics_page(api_url) == before


def test_a_statement_that_is_its_own_transaction_numbers_its_event_and_writes_the_row_once():
    """A link's statement (autocommit) takes its event's place in the stream's order itself, under the
    lock that orders them: the row is written once. An event recorded in a longer transaction is
    numbered at its commit by the trigger, which writes its row a second time; it sorts after."""
    from sqlalchemy import select, text

    from models import db, events, lifecycle, queries
    from models.calls import CallbackDelivery
    from tasks.delivery.events import record

    counting = [
        "CREATE TABLE test_row_writes (n integer NOT NULL)",
        "INSERT INTO test_row_writes VALUES (0)",
        "CREATE FUNCTION test_count_row_write() RETURNS trigger AS $$ BEGIN "
        "UPDATE test_row_writes SET n = n + 1; RETURN NULL; END; $$ LANGUAGE plpgsql",
        "CREATE TRIGGER test_count_row_write AFTER UPDATE ON callback_deliveries "
        "FOR EACH ROW EXECUTE FUNCTION test_count_row_write()",
    ]
    with db.engine().begin() as conn:
        for statement in counting:
            conn.execute(text(statement))

    def writes_and_number(event_id: str) -> tuple[int, int | None]:
        with db.engine().connect() as conn:
            n = conn.execute(text("SELECT n FROM test_row_writes")).scalar_one()
            number = conn.execute(select(CallbackDelivery.commit_seq)
                                  .where(CallbackDelivery.event_id == event_id)).scalar_one()
        return n, number

    try:
        call = make_call(callback_url="http://127.0.0.1:9/x")
        with db.session() as s:
            lifecycle.confirm(s, call.tool_call_id)
        with db.statement() as s:
            moved = lifecycle.record_step(s, call.tool_call_id, "PREPARING", {}, 0.25, event=events.event(
                "progress", step="PREPARING", gate=1, progress=0.25, inline=True))
        writes, first = writes_and_number(moved.delivery_event_id)
        assert writes == 0 and first is not None

        with db.session() as s:
            later = record(s, queries.get(s, call.tool_call_id), "progress", step="PREPARING", gate=1)
        writes, second = writes_and_number(later.event_id)
        assert writes == 1 and second is not None and second > first
    finally:
        with db.engine().begin() as conn:
            conn.execute(text("DROP TRIGGER test_count_row_write ON callback_deliveries"))
            conn.execute(text("DROP FUNCTION test_count_row_write()"))
            conn.execute(text("DROP TABLE test_row_writes"))
