"""Tools, OpenAPI, health, metrics, session context and the legacy aliases."""
from __future__ import annotations

import re
from pathlib import Path

from models import db, session_context
from tests.api_fixtures import GUIDE_EMAIL, snapshot
from tasks import tools
from tests.conftest import AUTH
from tests.helpers import row, wait_status

ALLOWED = {"type", "properties", "required", "enum", "description", "items"}


def _keys_ok(schema: dict) -> None:
    assert set(schema) <= ALLOWED, set(schema) - ALLOWED
    for sub in schema.get("properties", {}).values():
        _keys_ok(sub)
    if isinstance(schema.get("items"), dict):
        _keys_ok(schema["items"])


# -- /voice-tools/tools ----------------------------------------------------------------------

def test_tools_realtime_format(client):
    answer = client.get("/voice-tools/tools", headers=AUTH)
    assert answer.status_code == 200
    body = answer.get_json()
    assert body["format"] == "realtime"
    by_name = {t["name"]: t for t in body["tools"]}
    assert sorted(by_name) == tools.names()
    email = by_name["send_email"]
    assert set(email) == {"type", "name", "description", "parameters"}
    assert email["type"] == "function"
    assert email["parameters"]["type"] == "object"
    assert sorted(email["parameters"]["required"]) == ["subject", "to"]
    assert email["parameters"]["properties"]["to"] == {"type": "string", "description": "Recipient email address"}
    assert email["parameters"]["properties"]["cc"]["items"] == {"type": "string"}
    nested = by_name["query_vector_db"]["parameters"]["properties"]["structured_query"]
    assert nested["type"] == "object" and "semantic_query" in nested["properties"]
    for tool in body["tools"]:
        _keys_ok(tool["parameters"])


def test_tools_chat_format(client):
    body = client.get("/voice-tools/tools?format=chat", headers=AUTH).get_json()
    assert body["format"] == "chat"
    for tool in body["tools"]:
        assert set(tool) == {"type", "function"}
        assert set(tool["function"]) == {"name", "description", "parameters"}
        _keys_ok(tool["function"]["parameters"])


# -- /openapi.json, /healthz, /readyz, /metrics -------------------------------------------------

def test_openapi_lists_every_path(client):
    answer = client.get("/openapi.json", headers=AUTH)
    assert answer.status_code == 200
    spec = answer.get_json()
    assert spec["openapi"].startswith("3.")
    routes = {rule.rule.replace("<", "{").replace(">", "}") for rule in client.application.url_map.iter_rules()
              if rule.endpoint != "static" and not rule.endpoint.startswith("console_")}
    assert routes <= set(spec["paths"]), routes - set(spec["paths"])
    for path in ("/voice-tools/pending", "/voice-tools/modify/{tool_call_id}", "/voice-tools/confirm/{tool_call_id}",
                 "/voice-tools/execute", "/voice-tools/resume/{tool_call_id}", "/voice-tools/cancel/{tool_call_id}",
                 "/voice-tools/status/{tool_call_id}", "/voice-tools/context/{session_id}",
                 "/voice-tools/session-context", "/voice-tools/tools", "/execute-gmail", "/query-vector-db",
                 "/get-session-context", "/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert path in spec["paths"], path
    pending = spec["paths"]["/voice-tools/pending"]["post"]
    assert pending["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/PendingRequest")
    assert "201" in pending["responses"] and "422" in pending["responses"]
    confirm = spec["paths"]["/voice-tools/confirm/{tool_call_id}"]["post"]
    assert any(p["name"] == "wait" and p["in"] == "query" for p in confirm["parameters"])
    schemas = spec["components"]["schemas"]
    assert {"PendingRequest", "PendingAnswer", "CallRecord", "ErrorAnswer", "ModifyAnswer"} <= set(schemas)
    # one variant per tool: the tool named, its own parameters
    variants = [ref["$ref"].rsplit("/", 1)[1] for ref in schemas["PendingRequest"]["oneOf"]]
    assert len(variants) == len(tools.names())
    email = schemas["PendingSendEmail"]
    assert "session_id" in email["properties"]
    assert email["additionalProperties"] is False  # unknown fields are 422
    assert email["properties"]["function"]["enum"] == email["properties"]["function_name"]["enum"] == ["send_email"]
    assert email["properties"]["parameters"]["allOf"] == [{"$ref": "#/components/schemas/SendEmailParameters"}]
    assert sorted(email["required"]) == ["function", "parameters", "session_id"]  # typed by its tool
    assert schemas["PendingRequest"]["discriminator"]["mapping"]["send_email"] == "#/components/schemas/PendingSendEmail"
    assert "security" not in spec["paths"]["/healthz"]["get"]
    # path arguments say what they accept, as their loading schemas do
    [tool_call_id] = [p for p in confirm["parameters"] if p["in"] == "path"]
    [session_id] = spec["paths"]["/voice-tools/context/{session_id}"]["get"]["parameters"][:1]
    for parameter, name in ((tool_call_id, "tool_call_id"), (session_id, "session_id")):
        assert parameter["name"] == name and parameter["required"] is True
        assert parameter["schema"] == {"type": "string", "minLength": 1, "maxLength": 100,
                                       "pattern": "^[A-Za-z0-9_.:\\-]+$"}


def test_openapi_states_the_rules_the_server_enforces(client):
    from app.limits import MAX_REQUEST_LINE
    from app.openapi import TEXT_PATTERN

    spec = client.get("/openapi.json", headers=AUTH).get_json()
    schemas = spec["components"]["schemas"]
    confirm = spec["paths"]["/voice-tools/confirm/{tool_call_id}"]["post"]
    [wait] = [p for p in confirm["parameters"] if p["name"] == "wait"]
    assert wait["schema"]["minimum"] == 0 and wait["schema"]["exclusiveMinimum"] is True  # ?wait=0 is 422
    # every request string: no control characters (what schemas.Strict refuses)
    text = re.compile(TEXT_PATTERN)
    assert text.search("Hello\tthere\n") and not text.search("a\x00b") and not text.search("a\x1fb") \
        and not text.search("a\x7fb") and not text.search("a\x85b") and not text.search("a\x9fb")
    assert schemas["SendEmailParameters"]["properties"]["subject"]["pattern"] == TEXT_PATTERN
    assert schemas["CancelRequest"]["properties"]["reason"]["pattern"] == TEXT_PATTERN
    module = schemas["KnowledgeCheckParameters"]["properties"]["module"]
    assert module["pattern"] == "\\S" and module["allOf"] == [{"pattern": TEXT_PATTERN}]
    callback = re.compile(schemas["ConfirmRequest"]["properties"]["callback_url"]["pattern"])
    assert callback.search("https://relay.example/hook?x=1") and not callback.search("https://relay.example/\x01")
    assert "pattern" not in schemas["CallRecord"]["properties"]["voice_response"]  # answers untouched
    # a body with a required field is required; one without is not
    assert spec["paths"]["/voice-tools/resume/{tool_call_id}"]["post"]["requestBody"]["required"] is True
    assert "required" not in confirm["requestBody"]
    # gunicorn's limits, and the event stream's media type
    assert confirm["responses"]["414"]["description"].endswith(f"{MAX_REQUEST_LINE} bytes")
    assert "431" in confirm["responses"]
    events = spec["paths"]["/voice-tools/events/{session_id}"]["get"]["responses"]["200"]["content"]
    assert list(events) == ["text/event-stream"]
    assert "VOICE_TOOLS_CALLBACK_HOSTS" in spec["info"]["description"]


def test_openapi_documents_the_429_of_the_fair_shares(client):
    """Every operation but /healthz may answer 429 (docs/relay-guide.md, "Limits and small rules"):
    the JSON error body, with Retry-After."""
    spec = client.get("/openapi.json", headers=AUTH).get_json()
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            if path == "/healthz":
                assert "429" not in operation["responses"]
                continue
            limited = operation["responses"]["429"]
            assert limited["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorAnswer"}
            assert "Retry-After" in limited["headers"], (method, path)
            assert "rate_limited" in limited["description"] and "too_many_open" in limited["description"]


def test_healthz_and_readyz(client):
    from models import release

    assert client.get("/healthz").get_json() == {"status": "ok", "version": release.VERSION}
    setup_cfg = (Path(__file__).resolve().parent.parent / "setup.cfg").read_text()
    assert re.fullmatch(r"\d+\.\d+\.\d+", release.VERSION), release.VERSION  # a semantic version
    assert f"\nversion = {release.VERSION}\n" in setup_cfg
    ready = client.get("/readyz", headers=AUTH)
    assert ready.status_code == 200
    assert ready.get_json() == {"status": "ready", "checks": {"database": "ok", "broker": "ok"}}


def test_metrics_count_requests_by_endpoint_and_status(client):
    client.get("/voice-tools/status/tc_nothing", headers=AUTH)
    client.get("/voice-tools/status/tc_nothing")
    text = client.get("/metrics", headers=AUTH).get_data(as_text=True)
    assert 'voice_tools_http_requests_total{endpoint="/voice-tools/status/<tool_call_id>",method="GET",status="404"}' in text
    assert 'endpoint="/voice-tools/status/<tool_call_id>",method="GET",status="401"' in text
    assert "voice_tools_http_request_duration_seconds_bucket" in text


# -- session context ---------------------------------------------------------------------------

def test_session_context_found_and_expired(client):
    with db.session() as s:
        session_context.put_context(s, "sess", "last_query_results", {"summary": "Q3: 4.2M"}, 3600, caller="tests")
        session_context.put_context(s, "sess", "old", {"x": 1}, 0, caller="tests")
    answer = client.get("/voice-tools/session-context?session_id=sess&context_key=last_query_results", headers=AUTH)
    assert answer.status_code == 200
    body = answer.get_json()
    assert body["context"] == {"summary": "Q3: 4.2M"} and body["expires_at"]
    assert client.get("/voice-tools/session-context?session_id=sess&context_key=old", headers=AUTH).status_code == 404
    assert client.get("/voice-tools/session-context?session_id=x&context_key=last_query_results",
                      headers=AUTH).status_code == 404


def test_get_session_context_alias(client):
    with db.session() as s:
        session_context.put_context(s, "sess", "last_query_results", {"summary": "Q3"}, 3600, caller="tests")
    answer = client.get("/get-session-context?session_id=sess&context_key=last_query_results", headers=AUTH)
    assert answer.status_code == 200 and answer.get_json() == {"context": {"summary": "Q3"}}
    missing = client.get("/get-session-context?session_id=sess&context_key=nope", headers=AUTH)
    assert missing.status_code == 404
    assert missing.get_json()["error"] == "not_found"
    assert missing.get_json()["message"] == "Not found or expired"


# -- the legacy aliases ------------------------------------------------------------------------

def test_execute_gmail_flat_body(client, worker, relay):
    body = {"intent_id": "intent_123", "session_id": "sess_abc", "to": "john@example.com",
            "subject": "Project", "body": "Hello", "callback_url": relay.url}
    answer = client.post("/execute-gmail?wait=10", headers=AUTH, json=body)
    assert answer.status_code == 200, answer.get_json()
    record = answer.get_json()
    assert record["status"] == "PREPARED"
    assert record["function_name"] == "send_email"
    assert record["intent_id"] == "intent_123"
    assert record["parameters"] == {"to": "john@example.com", "subject": "Project", "body": "Hello", "cc": []}
    checkpoint = relay.wait_for(record["tool_call_id"], "checkpoint")
    assert checkpoint["requires_confirmation"] is True


def test_execute_gmail_rejects_unknown_flat_field(client):
    before = snapshot()
    answer = client.post("/execute-gmail", headers=AUTH,
                         json={"session_id": "s", "to": "a@example.com", "subject": "x", "bcc": "b@example.com"})
    assert answer.status_code == 422
    assert "bcc" in answer.get_json()["details"]["fields"]
    assert snapshot() == before


def test_query_vector_db_then_email_references_its_context(client, worker, relay):
    body = {"intent_id": "intent_q", "session_id": "sess_q", "user_query": "Q3 sales northwest",
            "structured_query": {"semantic_query": "quarterly sales northwest", "filters": {}},
            "callback_url": relay.url}
    answer = client.post("/query-vector-db?wait=20", headers=AUTH, json=body)
    assert answer.status_code == 200, answer.get_json()
    record = answer.get_json()
    assert record["status"] == "COMPLETED", record
    assert record["result"]["context_key"] == "last_query_results"
    assert record["voice_response"]
    stored = client.get("/voice-tools/session-context?session_id=sess_q&context_key=last_query_results", headers=AUTH)
    assert stored.status_code == 200
    assert stored.get_json()["context"]["query"] == "Q3 sales northwest"
    email = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_q", "function": "send_email",
        "parameters": {**GUIDE_EMAIL, "reference_context": "last_query_results"}})
    assert email.status_code == 201, email.get_json()
    elsewhere = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "other_session", "function": "send_email",
        "parameters": {**GUIDE_EMAIL, "reference_context": "last_query_results"}})
    assert elsewhere.status_code == 422
    assert "reference_context" in elsewhere.get_json()["details"]["fields"]["parameters"]
    assert wait_status(record["tool_call_id"]).status == "COMPLETED"
    assert row(email.get_json()["tool_call_id"]).status == "PENDING"
