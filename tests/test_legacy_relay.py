"""The legacy relay, written for the n8n workflows, unchanged but for its base URL and token
(docs/relay-guide.md, 'The legacy aliases and the `/webhook` paths' and 'A URL per event').

The legacy relay has one endpoint per kind of event (``/tool-progress``,
``/tool-checkpoint``, ``/tool-complete``), calls n8n's ``/webhook/...`` paths, and at
the checkpoint keeps the event's ``resume_webhook`` to POST ``{action}`` to it when
the caller says "send it". These tests play that relay over HTTP against the API and
a real worker.
"""
from __future__ import annotations

import pytest

from app.openapi import build
from tests.api_fixtures import GUIDE_EMAIL, call_count, snapshot
from tests.conftest import AUTH
from tests.helpers import deliveries, row, wait_status


def legacy_urls(relay) -> dict[str, str]:
    return {"progress": f"{relay.base}/tool-progress", "checkpoint": f"{relay.base}/tool-checkpoint",
            "completed": f"{relay.base}/tool-complete"}


def test_the_legacy_relay_plays_the_updating_email_walkthrough_on_n8n_paths_with_per_event_urls(client, worker, relay):
    created = client.post("/webhook/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_legacy", "function": "send_email", "intent_id": "intent_1",
        "parameters": {"to": "john@example.com", "subject": "Meeting Tomorrow"}})
    assert created.status_code == 201, created.get_json()
    tool_call_id = created.get_json()["tool_call_id"]
    modified = client.patch(f"/webhook/voice-tools/modify/{tool_call_id}", headers=AUTH,
                            json={"parameters": {"to": "john.smith@example.com"}})
    assert modified.status_code == 200 and modified.get_json()["status"] == "PENDING"

    confirmed = client.post(f"/webhook/voice-tools/confirm/{tool_call_id}", headers=AUTH,
                            json={"callback_urls": legacy_urls(relay)})
    assert confirmed.status_code == 202, confirmed.get_json()
    checkpoint = relay.wait_for(tool_call_id, "checkpoint")
    # the names the legacy relay's /tool-checkpoint handler reads
    assert checkpoint["checkpoint"] == "READY_TO_SEND" and checkpoint["status"] == "PREPARED"
    assert checkpoint["resume_webhook"] == checkpoint["resume_url"]
    assert checkpoint["resume_webhook"].endswith(f"/voice-tools/resume/{tool_call_id}")

    # handleFinalConfirmation: POST {action} to the kept resume_webhook (here through the test client)
    resume_path = "/" + checkpoint["resume_webhook"].split("/", 3)[3]
    resumed = client.post(resume_path + "?wait=15", headers=AUTH, data='{"action": "proceed"}')
    assert resumed.status_code == 200, resumed.get_json()
    assert resumed.get_json()["status"] == "COMPLETED"
    relay.wait_for(tool_call_id, "completed")

    at = relay.events_at(tool_call_id)
    assert {path for path, event in at if event == "progress"} == {"/tool-progress"}
    assert [path for path, event in at if event == "checkpoint"] == ["/tool-checkpoint"]
    assert [path for path, event in at if event == "completed"] == ["/tool-complete"]
    assert [d.seq for d in deliveries(tool_call_id)] == list(range(1, len(at) + 1))

    context = client.get("/webhook/voice-tools/context/sess_legacy", headers=AUTH).get_json()
    assert [c["tool_call_id"] for c in context["recent"]] == [tool_call_id]


def test_resume_execution_is_the_legacy_resume_webhook_path(client, worker, relay):
    created = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_legacy", "function": "send_email", "parameters": GUIDE_EMAIL,
        "callback_urls": {"checkpoint": f"{relay.base}/tool-checkpoint"}})
    tool_call_id = created.get_json()["tool_call_id"]
    client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH)
    relay.wait_for(tool_call_id, "checkpoint")
    cancelled = client.post(f"/webhook/resume-execution/{tool_call_id}", headers=AUTH, json={"action": "cancel"})
    assert cancelled.status_code == 200, cancelled.get_json()
    assert cancelled.get_json()["status"] == "CANCELLED"
    assert row(tool_call_id).status == "CANCELLED"
    # only the checkpoint had a URL: the other events were recorded (for the event stream), not posted
    recorded = deliveries(tool_call_id)
    assert [(d.event, d.state) for d in recorded] == [
        ("progress", "none"), ("checkpoint", "delivered"), ("cancelled", "none")]
    assert relay.events_at(tool_call_id) == [("/tool-checkpoint", "checkpoint")]


def test_events_not_named_in_callback_urls_go_to_callback_url(client, worker, relay):
    created = client.post("/execute-gmail", headers=AUTH, json={
        "session_id": "sess_legacy", "intent_id": "intent_9", "to": "a@example.com", "subject": "Hi",
        "callback_url": f"{relay.base}/tool-progress",
        "callback_urls": {"checkpoint": f"{relay.base}/tool-checkpoint"}})
    assert created.status_code == 202, created.get_json()
    tool_call_id = created.get_json()["tool_call_id"]
    relay.wait_for(tool_call_id, "checkpoint")
    assert client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH).status_code == 200
    relay.wait_for(tool_call_id, "cancelled")
    at = relay.events_at(tool_call_id)
    assert ("/tool-checkpoint", "checkpoint") in at and ("/tool-progress", "cancelled") in at
    assert all(path == "/tool-progress" for path, event in at if event != "checkpoint"), at
    assert row(tool_call_id).callback_urls == {"checkpoint": f"{relay.base}/tool-checkpoint"}


@pytest.mark.parametrize("body, field", [
    ({"callback_url": "http://user:secret@127.0.0.1:9/tool-progress"}, "callback_url"),
    ({"callback_urls": {"checkpoint": "http://user:secret@127.0.0.1:9/x"}}, "callback_urls"),
    ({"callback_urls": {"checkpoint": "http://evil.example.com/x"}}, "callback_urls"),
    ({"callback_urls": {"whenever": "http://127.0.0.1:9/x"}}, "callback_urls"),
    ({"callback_urls": "http://127.0.0.1:9/x"}, "callback_urls"),
])
def test_bad_callback_urls_are_422_naming_the_field_and_change_nothing(client, body, field):
    before = snapshot()
    answer = client.post("/voice-tools/pending", headers=AUTH,
                         json={"session_id": "s", "function": "send_email", "parameters": GUIDE_EMAIL, **body})
    assert answer.status_code == 422, answer.get_json()
    assert field in answer.get_json()["details"]["fields"], answer.get_json()
    if "secret" in str(body):
        assert "secret" not in answer.get_data(as_text=True) or "credentials" in answer.get_data(as_text=True)
    assert snapshot() == before and call_count() == 0


def test_every_api_path_answers_under_webhook_too_and_openapi_marks_the_aliases(client):
    answers = [client.get("/webhook/voice-tools/status/tc_000000000000", headers=AUTH),
               client.get("/voice-tools/status/tc_000000000000", headers=AUTH)]
    assert [a.status_code for a in answers] == [404, 404]
    assert answers[0].get_json()["error"] == answers[1].get_json()["error"] == "not_found"
    assert client.get("/webhook/voice-tools/tools", headers=AUTH).get_json() == \
        client.get("/voice-tools/tools", headers=AUTH).get_json()
    assert client.get("/webhook/voice-tools/tools").status_code == 401  # the same token rule

    rules = {r.rule for r in client.application.url_map.iter_rules()}
    api_paths = {r.rule for r in client.application.url_map.iter_rules() if r.endpoint.startswith("api.")}
    assert {f"/webhook{p}" for p in api_paths} <= rules
    paths = build(client.application)["paths"]
    assert paths["/webhook/voice-tools/pending"]["post"]["x-alias-of"] == "/voice-tools/pending"
    assert paths["/webhook/resume-execution/{tool_call_id}"]["post"]["x-alias-of"] == "/voice-tools/resume/{tool_call_id}"
    assert "x-alias-of" not in paths["/voice-tools/pending"]["post"]


def test_the_legacy_relay_searches_then_emails_the_results_on_the_legacy_aliases(client, worker, relay):
    """The legacy aliases end to end: /query-vector-db, /get-session-context, /execute-gmail, on n8n paths."""
    from voice_tools_backends import documents

    documents.load_demo()
    searched = client.post("/webhook/query-vector-db", headers=AUTH, json={
        "intent_id": "intent_9", "session_id": "sess_final", "user_query": "Q3 sales northwest",
        "structured_query": {"semantic_query": "quarterly sales northwest", "filters": {"region": "northwest"}},
        "callback_urls": legacy_urls(relay)})
    assert searched.status_code == 202, searched.get_json()
    search_id = searched.get_json()["tool_call_id"]
    done = relay.wait_for(search_id, "completed")
    assert done["context_available"] is True and done["context_key"] == "last_query_results"
    assert ("/tool-complete", "completed") in relay.events_at(search_id)
    top = done["result"]["documents"][0]["title"]

    stored = client.get("/webhook/get-session-context?session_id=sess_final&context_key=last_query_results",
                        headers=AUTH)
    assert stored.status_code == 200 and stored.get_json()["context"]["documents"][0]["title"] == top

    sent = client.post("/webhook/execute-gmail", headers=AUTH, json={
        "intent_id": "intent_10", "session_id": "sess_final", "to": "john.smith@example.com",
        "subject": "Q3 sales", "body": "The numbers you asked for.", "reference_context": "last_query_results",
        "callback_urls": legacy_urls(relay)})
    assert sent.status_code == 202, sent.get_json()
    email_id = sent.get_json()["tool_call_id"]
    checkpoint = relay.wait_for(email_id, "checkpoint")
    assert top in checkpoint["preview"]["body"]  # the draft carries the search's results
    resume_path = "/" + checkpoint["resume_webhook"].split("/", 3)[3]
    assert client.post(resume_path, headers=AUTH, json={"action": "proceed"}).status_code == 202
    completed = relay.wait_for(email_id, "completed")
    assert completed["voice_response"] == "Email sent to john.smith@example.com."
    assert [p for p, e in relay.events_at(email_id) if e == "completed"] == ["/tool-complete"]
    assert wait_status(email_id).status == "COMPLETED"
