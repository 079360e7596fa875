"""Callers fenced from each other (docs/promises.md, Callers).

A call, its session context and its events belong to the token name that created them:
another caller's token gets the 404 of an unknown id and nothing changes; a token marked
``:admin`` sees and acts on everything; idempotency keys are per caller. Three tokens:
the tests' own (``tests``, conftest's AUTH), a second relay's (``bob``) and an operator's
(``ops``, ``:admin``), set for each test and restored after.
"""
from __future__ import annotations

import pytest
import requests

from models import db, session_context
from tasks.tools import StepInput
from tests.api_fixtures import GUIDE_EMAIL, call_count, snapshot
from tests.conftest import API_TOKEN, AUTH
from tests.helpers import deliveries, row, wait_status
from support.sse_client import Stream

BOB = {"Authorization": "Bearer bob-token"}
OPS = {"Authorization": "Bearer ops-token"}
UNKNOWN_ID = "tc_000000000000"


@pytest.fixture(autouse=True)
def three_tokens(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN},bob:bob-token,ops:ops-token:admin")


def record(client, headers=AUTH, session_id="sess_shared", key: str | None = None, **extra):
    """POST /voice-tools/pending of a send_email as ``headers``' caller (``key``: its Idempotency-Key)."""
    answer = client.post("/voice-tools/pending", headers={**headers, **({"Idempotency-Key": key} if key else {})},
                         json={"session_id": session_id, "function": "send_email", "parameters": GUIDE_EMAIL, **extra})
    assert answer.status_code in (200, 201), answer.get_json()
    return answer


# (method, path, json) of every action or read by id, on the API's paths and the /webhook ones
BY_ID = [
    ("GET", "/voice-tools/status/{id}", None),
    ("PATCH", "/voice-tools/modify/{id}", {"parameters": {"to": "bob@example.com"}}),
    ("POST", "/voice-tools/confirm/{id}", {}),
    ("POST", "/voice-tools/confirm/{id}?wait=1", {}),
    ("POST", "/voice-tools/resume/{id}", {"action": "proceed"}),
    ("POST", "/voice-tools/resume/{id}", {"action": "cancel"}),
    ("DELETE", "/voice-tools/cancel/{id}", {"reason": "not mine"}),
    ("GET", "/webhook/voice-tools/status/{id}", None),
    ("PATCH", "/webhook/voice-tools/modify/{id}", {"parameters": {"to": "bob@example.com"}}),
    ("POST", "/webhook/voice-tools/confirm/{id}", {}),
    ("POST", "/webhook/resume-execution/{id}", {"action": "cancel"}),
    ("DELETE", "/webhook/voice-tools/cancel/{id}", None),
]


@pytest.mark.parametrize("method,path,body", BY_ID, ids=[f"{m} {p}" for m, p, _ in BY_ID])
def test_another_callers_call_is_an_unknown_id_and_nothing_of_it_changes(client, method, path, body):
    tool_call_id = record(client).get_json()["tool_call_id"]
    before = snapshot()
    foreign = client.open(path.format(id=tool_call_id), method=method, headers=BOB, json=body)
    unknown = client.open(path.format(id=UNKNOWN_ID), method=method, headers=BOB, json=body)
    assert foreign.status_code == unknown.status_code == 404, foreign.get_json()
    assert foreign.get_json() == {"error": "not_found", "message": f"No tool call {tool_call_id}.",
                                  "details": {"tool_call_id": tool_call_id}}
    assert unknown.get_json() == {"error": "not_found", "message": f"No tool call {UNKNOWN_ID}.",
                                  "details": {"tool_call_id": UNKNOWN_ID}}
    assert snapshot() == before
    # its owner still can
    assert client.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH).status_code == 200


def test_an_admin_token_sees_and_cancels_any_callers_call(client):
    tool_call_id = record(client, headers=BOB).get_json()["tool_call_id"]
    seen = client.get(f"/voice-tools/status/{tool_call_id}", headers=OPS)
    assert seen.status_code == 200 and seen.get_json()["caller"] == "bob"
    context = client.get("/voice-tools/context/sess_shared", headers=OPS).get_json()
    assert [c["tool_call_id"] for c in context["pending"]] == [tool_call_id]
    cancelled = client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=OPS, json={"reason": "Operator"})
    assert cancelled.status_code == 200 and cancelled.get_json()["status"] == "CANCELLED"
    assert (row(tool_call_id).status, row(tool_call_id).error_message, row(tool_call_id).caller) == \
        ("CANCELLED", "Operator", "bob")
    # an admin's own calls are recorded under its name, and other callers do not see them
    mine = record(client, headers=OPS, session_id="sess_ops").get_json()["tool_call_id"]
    assert row(mine).caller == "ops"
    assert client.get(f"/voice-tools/status/{mine}", headers=BOB).status_code == 404


def test_context_of_a_shared_session_id_shows_only_ones_own_calls(client):
    ours = record(client).get_json()["tool_call_id"]
    bobs = record(client, headers=BOB).get_json()["tool_call_id"]
    finished = record(client, headers=BOB, parameters={"to": "x@example.com", "subject": "Done"}).get_json()
    assert client.delete(f"/voice-tools/cancel/{finished['tool_call_id']}", headers=BOB).status_code == 200
    for path in ("/voice-tools/context/sess_shared", "/webhook/voice-tools/context/sess_shared"):
        as_tests = client.get(path, headers=AUTH).get_json()
        as_bob = client.get(path, headers=BOB).get_json()
        assert [c["tool_call_id"] for c in as_tests["pending"]] == [ours] and as_tests["recent"] == []
        assert [c["tool_call_id"] for c in as_bob["pending"]] == [bobs]
        assert [c["tool_call_id"] for c in as_bob["recent"]] == [finished["tool_call_id"]]


def test_session_context_is_the_callers_own_on_every_path(client):
    from tasks.tools import query_vector_db, send_email

    searched = {"summary": "Bob's Q3", "documents": []}
    # the query link stores under the caller of its call (as a worker does)
    query_vector_db.store_context(StepInput("tc_bobquery001", "sess_shared", {"user_query": "Q3"},
                                            {"SEARCHING": searched}, "bob"))
    with db.session() as s:
        session_context.put_context(s, "sess_shared", "notes", {"who": "tests"}, 3600, caller="tests")
        session_context.put_context(s, "sess_shared", "notes", {"who": "bob"}, 3600, caller="bob")
    query = "?session_id=sess_shared&context_key=last_query_results"
    for path in ("/voice-tools/session-context", "/get-session-context", "/webhook/get-session-context",
                 "/webhook/voice-tools/session-context"):
        mine = client.get(path + query, headers=BOB)
        assert mine.status_code == 200 and mine.get_json()["context"]["summary"] == "Bob's Q3"
        hidden = client.get(path + query, headers=AUTH)  # as a key nobody stored
        missing = client.get(path + "?session_id=sess_shared&context_key=nothing_here", headers=AUTH)
        assert hidden.status_code == missing.status_code == 404
        assert (hidden.get_json()["error"], hidden.get_json()["message"]) == \
            (missing.get_json()["error"], missing.get_json()["message"]) == ("not_found", "Not found or expired")
    notes = "/voice-tools/session-context?session_id=sess_shared&context_key=notes"
    assert client.get(notes, headers=AUTH).get_json()["context"] == {"who": "tests"}
    assert client.get(notes, headers=BOB).get_json()["context"] == {"who": "bob"}
    assert client.get(notes, headers=OPS).status_code == 200  # an operator reads the newest of any caller's

    # an email may refer only to its own caller's context: 422 for the other, as for a missing one
    before = snapshot()
    refused = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_shared", "function": "send_email",
        "parameters": {**GUIDE_EMAIL, "reference_context": "last_query_results"}})
    assert refused.status_code == 422 and "reference_context" in refused.get_json()["details"]["fields"]["parameters"]
    assert snapshot() == before
    assert record(client, headers=BOB, parameters={**GUIDE_EMAIL, "reference_context": "last_query_results"})
    with pytest.raises(Exception, match="expired"):  # and the link reads its own caller's only
        send_email.referenced("sess_shared", "last_query_results", "tests")
    assert send_email.referenced("sess_shared", "last_query_results", "bob")[1]["context_key"] == "last_query_results"


def test_one_idempotency_key_used_by_two_callers_makes_two_calls(client):
    key = {"key": "relay-key-1"}
    ours = record(client, **key)
    bobs = record(client, headers=BOB, **key)
    assert ours.status_code == bobs.status_code == 201
    assert ours.get_json()["tool_call_id"] != bobs.get_json()["tool_call_id"] and call_count() == 2
    assert record(client, **key).get_json()["tool_call_id"] == ours.get_json()["tool_call_id"]
    replay = record(client, headers=BOB, **key)
    assert replay.status_code == 200 and replay.get_json()["tool_call_id"] == bobs.get_json()["tool_call_id"]
    assert call_count() == 2
    # other content under bob's key is bob's conflict, whatever the tests' token did with it
    other = client.post("/voice-tools/pending", headers={**BOB, "Idempotency-Key": "relay-key-1"},
                        json={"session_id": "sess_shared", "function": "send_email",
                              "parameters": {"to": "else@example.com", "subject": "Other"}})
    assert other.status_code == 409 and other.get_json()["details"]["tool_call_id"] == bobs.get_json()["tool_call_id"]


@pytest.mark.parametrize("path", ["/voice-tools/pending", "/voice-tools/execute", "/webhook/voice-tools/execute"])
def test_another_callers_tool_call_id_is_a_conflict_that_tells_nothing_of_its_call(client, path):
    ours = record(client, tool_call_id="tc_relaygiven01")
    assert ours.status_code == 201
    before = snapshot()
    taken = client.post(path, headers=BOB, json={"session_id": "sess_shared", "function": "send_email",
                                                 "tool_call_id": "tc_relaygiven01", "parameters": GUIDE_EMAIL})
    assert taken.status_code == 409
    assert taken.get_json() == {
        "error": "idempotency_conflict",
        "message": "The tool_call_id 'tc_relaygiven01' is already in use; give another one (or none).",
        "details": {"tool_call_id": "tc_relaygiven01"}}
    assert snapshot() == before


def test_the_event_stream_of_a_shared_session_id_shows_only_ones_own_calls(api_url, worker, monkeypatch):
    def start(headers) -> str:
        created = requests.post(f"{api_url}/voice-tools/pending", headers=headers, timeout=10, json={
            "session_id": "sess_sse_shared", "function": "send_email", "parameters": GUIDE_EMAIL})
        assert created.status_code == 201, created.text
        tool_call_id = created.json()["tool_call_id"]
        assert requests.post(f"{api_url}/voice-tools/confirm/{tool_call_id}", headers=headers,
                             timeout=10).status_code == 202
        wait_status(tool_call_id, "PREPARED")
        return tool_call_id

    ours = start(AUTH)  # its events are recorded first: an unfenced stream would show them first
    bobs = start(BOB)
    url = f"{api_url}/voice-tools/events/sess_sse_shared"
    bob_stream = Stream(url, BOB)
    assert requests.delete(f"{api_url}/voice-tools/cancel/{bobs}", headers=BOB, timeout=10).status_code == 200
    seen = [bob_stream.next_event() for _ in range(3)]
    bob_stream.close()
    assert [(e["tool_call_id"], e["event"]) for _, e in seen] == \
        [(bobs, "progress"), (bobs, "checkpoint"), (bobs, "cancelled")]
    assert [i for i, _ in seen] == [d.event_id for d in deliveries(bobs)]

    # another caller's event id is not one of this caller's events: 422, as an unknown one
    foreign = requests.get(url, headers={**BOB, "Last-Event-ID": deliveries(ours)[0].event_id}, timeout=10)
    assert foreign.status_code == 422 and foreign.json()["error"] == "validation_error"

    ops_stream = Stream(url, OPS)  # the operator sees every caller's events, in the stream's order
    everything = [ops_stream.next_event() for _ in range(5)]
    ops_stream.close()
    assert sorted(i for i, _ in everything) == sorted(d.event_id for d in deliveries(ours) + deliveries(bobs))
    assert everything[0][1]["tool_call_id"] == ours


def test_migration_0009_matches_the_models_of_the_fenced_tables():
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from sqlalchemy import text

    from models.calls import Base

    with db.engine().connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        indexes = {r.indexname: r.indexdef for r in conn.execute(text(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename IN ('tool_calls', 'session_context')"))}
    fenced = ("tool_calls", "session_context")
    touched = [d for d in diff if isinstance(d, tuple) and any(
        getattr(x, "name", None) in fenced or getattr(getattr(x, "table", None), "name", None) in fenced for x in d)]
    assert touched == [], touched
    assert "UNIQUE" in indexes["uq_tool_calls_caller_idempotency_key"]
    assert "(caller, session_id, context_key)" in indexes["uq_session_context_key"]
    assert "tool_calls_idempotency_key_key" not in indexes


def test_tokens_parse_name_token_and_the_admin_mark():
    import hashlib

    from tasks.calls.callers import Caller, entries_of, who_for

    entries = ["tests:t1", "ops:t2:admin", "odd:t3:with-colon", "bare-token", " spaced : t4 : admin "]
    assert entries_of(entries) == [
        ("tests", b"t1", False), ("ops", b"t2", True), ("odd", b"t3:with-colon", False),
        (hashlib.sha256(b"bare-token").hexdigest()[:8], b"bare-token", False), ("spaced", b"t4", True)]
    assert who_for("t2", entries) == Caller("ops", admin=True) and Caller("ops", True).scope is None
    assert who_for("t3:with-colon", entries) == Caller("odd") and Caller("odd").scope == "odd"
    assert who_for("t3", entries) is None and who_for("admin", entries) is None
