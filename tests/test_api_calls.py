"""The call endpoints' happy paths, first the walkthrough of docs/relay-guide.md's curls
("Record, correct, confirm" and "Read"): record, correct, cancel, confirm, read."""
from __future__ import annotations

import json

from models.calls import PENDING
from tests.api_fixtures import GUIDE_EMAIL, call_count, created_id, pending
from tests.conftest import AUTH
from tests.helpers import make_call, row, wait_status


# -- the relay guide's walkthrough ----------------------------------------------------------

def test_guide_pending_without_body_field(client):
    # curl -X POST .../voice-tools/pending -H "Content-Type: application/json" -d '{...}'
    answer = client.post("/voice-tools/pending", headers={**AUTH, "Content-Type": "application/json"},
                         data='{"session_id":"test_123","function":"send_email",'
                              '"parameters":{"to":"test@example.com","subject":"Test"}}')
    assert answer.status_code == 201, answer.get_json()
    body = answer.get_json()
    assert body["tool_call_id"].startswith("tc_") and len(body["tool_call_id"]) == 15
    assert body["status"] == "PENDING"
    assert body["message"] == "Ready to send email to test@example.com. Confirm to proceed."
    assert body["confirmation_message"] == body["message"]
    assert body["function_name"] == "send_email"
    assert body["parameters"] == {"to": "test@example.com", "subject": "Test", "body": "", "cc": []}
    assert body["actions_available"] == ["confirm", "modify", "cancel"]
    stored = row(body["tool_call_id"])
    assert (stored.status, stored.session_id, stored.caller) == ("PENDING", "test_123", "tests")
    assert stored.parameters["body"] == ""


def test_guide_modify_tracks_history(client):
    tool_call_id = created_id(client)
    answer = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                          data='{"parameters":{"to":"updated@example.com"}}')
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    assert body["status"] == "PENDING"
    assert body["tool_call_id"] == tool_call_id
    assert body["updated_parameters"]["to"] == "updated@example.com"
    assert body["updated_parameters"]["subject"] == "Test"
    assert body["changes"] == [{"field": "to", "old": "test@example.com", "new": "updated@example.com"}]
    assert body["message"] == "Updated to updated@example.com. Confirm?"
    stored = row(tool_call_id)
    assert stored.parameters["to"] == "updated@example.com"
    [entry] = stored.parameters_history
    assert (entry["field"], entry["old"], entry["new"]) == ("to", "test@example.com", "updated@example.com")
    assert entry["at"]
    assert [h["status"] for h in stored.status_history] == ["PENDING", "MODIFIED", "PENDING"]
    assert stored.status_history[1]["fields"] == ["to"]


def test_guide_cancel_without_body(client):
    tool_call_id = created_id(client)
    answer = client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH)
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    assert body["status"] == "CANCELLED"
    assert body["voice_response"] == "Cancelled. The email was not sent."
    stored = row(tool_call_id)
    assert stored.status == "CANCELLED"
    assert stored.error_message == "Cancelled by user"
    assert stored.completed_at is not None


def test_guide_confirm_runs_to_completed_with_result(client, worker):
    # a body sent with no Content-Type is read as JSON; send_email stops at its checkpoint first
    answer = client.post("/voice-tools/pending", headers=AUTH,
                         data='{"session_id":"test_456","function":"send_email",'
                              '"parameters":{"to":"test@example.com","subject":"Test"}}')
    assert answer.status_code == 201
    tool_call_id = answer.get_json()["tool_call_id"]
    prepared = client.post(f"/voice-tools/confirm/{tool_call_id}?wait=10", headers=AUTH)
    assert prepared.status_code == 200, prepared.get_json()
    assert prepared.get_json()["status"] == "PREPARED"
    assert prepared.get_json()["current_step"] == "READY_TO_SEND"
    done = client.post(f"/voice-tools/resume/{tool_call_id}?wait=10", headers=AUTH, json={"action": "proceed"})
    assert done.status_code == 200, done.get_json()
    body = done.get_json()
    assert body["status"] == "COMPLETED", body
    assert body["result"]["to"] == "test@example.com"
    assert body["result"]["message_id"]
    assert body["voice_response"] == "Email sent to test@example.com."
    stored = row(tool_call_id)
    assert stored.status == "COMPLETED" and stored.result == body["result"]


def test_guide_context_lists_recent(client, worker):
    tool_call_id = created_id(client, session_id="test_456")
    client.post(f"/voice-tools/confirm/{tool_call_id}?wait=10", headers=AUTH)
    client.post(f"/voice-tools/resume/{tool_call_id}?wait=10", headers=AUTH, json={"action": "proceed"})
    assert row(tool_call_id).status == "COMPLETED"
    answer = client.get("/voice-tools/context/test_456", headers=AUTH)
    assert answer.status_code == 200
    body = answer.get_json()
    assert body["pending"] == []
    [recent] = body["recent"]
    assert recent["function_name"] == "send_email"
    assert recent["status"] == "COMPLETED"
    assert recent["voice_response"] == "Email sent to test@example.com."
    assert recent["tool_call_id"] == tool_call_id
    assert recent["parameters_history"] == []


# -- each endpoint -----------------------------------------------------------------------

def test_pending_keeps_relay_ids_and_callback_url(client, relay):
    answer = pending(client, {"session_id": "s1", "function_name": "send_email", "parameters": GUIDE_EMAIL,
                              "tool_call_id": "call_ABC.123", "connection_id": "conn-1", "intent_id": "intent_9",
                              "callback_url": relay.url})
    assert answer.status_code == 201, answer.get_json()
    stored = row("call_ABC.123")
    assert (stored.connection_id, stored.intent_id, stored.callback_url) == ("conn-1", "intent_9", relay.url)
    assert stored.action_level == "write"


def test_modify_twice_keeps_every_change(client):
    tool_call_id = created_id(client)
    client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH, json={"parameters": {"to": "a@example.com"}})
    answer = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                          json={"parameters": {"to": "b@example.com", "body": "Hello"}})
    assert answer.status_code == 200
    assert answer.get_json()["changes"] == [
        {"field": "body", "old": "", "new": "Hello"},
        {"field": "to", "old": "a@example.com", "new": "b@example.com"},
    ]
    stored = row(tool_call_id)
    assert [(h["field"], h["new"]) for h in stored.parameters_history] == [
        ("to", "a@example.com"), ("body", "Hello"), ("to", "b@example.com")]
    assert [h["status"] for h in stored.status_history] == ["PENDING", "MODIFIED", "PENDING", "MODIFIED", "PENDING"]


def test_modify_with_same_values_changes_nothing(client):
    tool_call_id = created_id(client)
    answer = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                          json={"parameters": {"to": "test@example.com"}})
    assert answer.status_code == 200
    assert answer.get_json()["changes"] == []
    stored = row(tool_call_id)
    assert stored.parameters_history == [] and len(stored.status_history) == 1


def test_confirm_answers_202_and_enqueues(client, worker, relay):
    tool_call_id = created_id(client)
    answer = client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH, json={"callback_url": relay.url})
    assert answer.status_code == 202, answer.get_json()
    body = answer.get_json()
    assert body["status"] == "EXECUTING"
    assert body["message"] == "Preparing the email to test@example.com."
    assert body["workflow_id"]
    assert row(tool_call_id).callback_url == relay.url
    relay.wait_for(tool_call_id, "checkpoint")
    assert wait_status(tool_call_id, "PREPARED").workflow_id == body["workflow_id"]


def test_execute_records_and_starts(client, worker):
    answer = client.post("/voice-tools/execute?wait=10", headers=AUTH,
                         json={"session_id": "s2", "function": "send_email", "parameters": GUIDE_EMAIL})
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    assert body["status"] == "PREPARED"  # a write tool with a checkpoint still stops there
    history = [h["status"] for h in row(body["tool_call_id"]).status_history]
    assert history == ["PENDING", "EXECUTING", "PREPARED"]


def test_execute_without_wait_is_202(client, worker):
    answer = client.post("/voice-tools/execute", headers=AUTH,
                         json={"session_id": "s2", "function": "send_email", "parameters": GUIDE_EMAIL})
    assert answer.status_code == 202
    assert answer.get_json()["status"] == "EXECUTING"
    wait_status(answer.get_json()["tool_call_id"], "PREPARED")


def test_resume_proceed_202_then_completes(client, worker):
    tool_call_id = created_id(client)
    client.post(f"/voice-tools/confirm/{tool_call_id}?wait=10", headers=AUTH)
    answer = client.post(f"/voice-tools/resume/{tool_call_id}", headers=AUTH, json={"action": "proceed"})
    assert answer.status_code == 202, answer.get_json()
    assert answer.get_json()["status"] == "EXECUTING"
    assert answer.get_json()["message"] == "Sending the email to test@example.com."
    assert wait_status(tool_call_id).status == "COMPLETED"


def test_resume_cancel_at_checkpoint(client, worker):
    tool_call_id = created_id(client)
    client.post(f"/voice-tools/confirm/{tool_call_id}?wait=10", headers=AUTH)
    answer = client.post(f"/voice-tools/resume/{tool_call_id}", headers=AUTH,
                         json={"action": "cancel", "reason": "Changed my mind"})
    assert answer.status_code == 200
    assert answer.get_json()["status"] == "CANCELLED"
    assert answer.get_json()["voice_response"] == "Cancelled. The email was not sent."
    stored = row(tool_call_id)
    assert (stored.status, stored.error_message, stored.committed_at) == ("CANCELLED", "Changed my mind", None)


def test_cancel_reason_from_query_or_body(client):
    first, second = created_id(client), created_id(client)
    assert client.delete(f"/voice-tools/cancel/{first}?reason=Wrong+person", headers=AUTH).status_code == 200
    assert client.delete(f"/voice-tools/cancel/{second}", headers=AUTH, json={"reason": "Typo"}).status_code == 200
    assert row(first).error_message == "Wrong person"
    assert row(second).error_message == "Typo"


def test_status_is_the_whole_record(client):
    tool_call_id = created_id(client, intent_id="intent_1")
    client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH, json={"parameters": {"subject": "New"}})
    answer = client.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH)
    assert answer.status_code == 200
    body = answer.get_json()
    for key in ("tool_call_id", "session_id", "intent_id", "function_name", "action_level", "parameters",
                "parameters_history", "status", "status_history", "current_step", "progress", "result",
                "voice_response", "error_message", "committed_at", "workflow_id", "caller", "created_at",
                "confirmed_at", "executed_at", "prepared_at", "completed_at", "execution_time_ms"):
        assert key in body, key
    assert body["caller"] == "tests"
    assert body["parameters_history"][0]["field"] == "subject"
    assert [h["status"] for h in body["status_history"]] == ["PENDING", "MODIFIED", "PENDING"]
    json.dumps(body)


def test_context_pending_and_recent_newest_first(client):
    open_call = make_call(session_id="ctx")
    done = [make_call(session_id="ctx", parameters={"to": f"p{i}@example.com", "subject": "s"}) for i in range(3)]
    make_call(session_id="other")
    for call in done:
        assert client.delete(f"/voice-tools/cancel/{call.tool_call_id}", headers=AUTH).status_code == 200
    body = client.get("/voice-tools/context/ctx?limit=2", headers=AUTH).get_json()
    assert [c["tool_call_id"] for c in body["pending"]] == [open_call.tool_call_id]
    assert [c["tool_call_id"] for c in body["recent"]] == [done[2].tool_call_id, done[1].tool_call_id]
    item = body["pending"][0]
    for key in ("tool_call_id", "function_name", "parameters", "parameters_history", "status", "current_step",
                "result", "voice_response", "created_at"):
        assert key in item


def test_context_unknown_session_is_empty(client):
    answer = client.get("/voice-tools/context/nobody", headers=AUTH)
    assert answer.status_code == 200
    assert answer.get_json()["pending"] == [] and answer.get_json()["recent"] == []


def test_pending_with_reference_context(client):
    from models import db, session_context

    with db.session() as s:
        session_context.put_context(s, "test_123", "last_query_results", {"summary": "Q3"}, 3600, caller="tests")
    params = {**GUIDE_EMAIL, "reference_context": "last_query_results"}
    answer = pending(client, {"session_id": "test_123", "function": "send_email", "parameters": params})
    assert answer.status_code == 201, answer.get_json()
    assert row(answer.get_json()["tool_call_id"]).status == PENDING
    assert call_count() == 1


def test_context_bounds_the_pending_list_as_it_bounds_recent(client):
    """A session with many open calls answers at most ``limit`` of them, newest first."""
    opened = [make_call(session_id="busy", parameters={"to": f"p{i}@example.com", "subject": "s"})
              for i in range(12)]
    newest_first = [call.tool_call_id for call in reversed(opened)]
    body = client.get("/voice-tools/context/busy?limit=3", headers=AUTH).get_json()
    assert [c["tool_call_id"] for c in body["pending"]] == newest_first[:3]
    body = client.get("/voice-tools/context/busy", headers=AUTH).get_json()  # default 10
    assert [c["tool_call_id"] for c in body["pending"]] == newest_first[:10]
    assert body["recent"] == []
