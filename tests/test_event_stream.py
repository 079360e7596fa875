"""GET /voice-tools/events/<session_id>: the session's events as Server-Sent Events (docs/relay-guide.md, The event stream).

The API runs in a real threaded HTTP server (the ``api_url`` fixture) so the stream is
read over HTTP as a relay would (``support/sse_client.py``); calls run on the in-process worker.
"""
from __future__ import annotations

import requests

from tests.api_fixtures import GUIDE_EMAIL
from tests.conftest import AUTH
from tests.helpers import deliveries, wait_status
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
    gen = stream.stream("sess_idle", "0", 0, keepalive_s=0.2)
    assert next(gen).startswith(":")
    assert next(gen) == ": keep-alive\n\n"  # nothing to send: a comment after the keep-alive interval
    assert db.engine().pool.checkedout() == checked_out_before  # idle: no connection held
    gen.close()
