"""Every error class answers JSON {error, message, details} and leaves the database as it was."""
from __future__ import annotations

import json

import pytest

from models import db, lifecycle
from tasks import tools
from tests.api_fixtures import GUIDE_EMAIL, call_count, created_id, pending, snapshot
from tests.conftest import API_TOKEN, AUTH
from tests.helpers import row

BODY = {"session_id": "test_123", "function": "send_email", "parameters": GUIDE_EMAIL}


def assert_error(answer, status: int, error: str) -> dict:
    assert answer.status_code == status, answer.get_data(as_text=True)
    assert answer.is_json, answer.get_data(as_text=True)
    body = answer.get_json()
    assert set(body) == {"error", "message", "details"}, body
    assert body["error"] == error, body
    assert isinstance(body["message"], str) and body["message"]
    return body


@pytest.fixture
def existing(client):
    """One PENDING call, and the database as it is before the request under test."""
    tool_call_id = created_id(client)
    return tool_call_id, snapshot()


# -- 400 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("data", ['{"session_id": "x",', "[1, 2]", '"text"', "null", '{"a": NaN}',
                                  '{"a": 1e999}', "\xff\xfe", "[" * 100_000,
                                  '{"session_id": "s", "parameters": {"a": %s}}' % ("[" * 900 + "]" * 900)])
def test_bad_json_is_400(client, existing, data):
    _, before = existing
    body = assert_error(client.post("/voice-tools/pending", headers=AUTH, data=data), 400, "bad_json")
    assert body["message"]
    assert snapshot() == before


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_is_utf8_alone_without_a_byte_order_mark(client, existing, encoding):
    """One reading of a body: UTF-8, no BOM (as MCP's). A UTF-16 or UTF-32 body, or one with a BOM, is 400."""
    _, before = existing
    data = json.dumps(BODY).encode(encoding)
    for path in ("/voice-tools/pending", "/voice-tools/execute"):
        body = assert_error(client.post(path, headers={**AUTH, "Content-Type": "application/json"}, data=data),
                            400, "bad_json")
        assert "UTF-8" in body["message"], body
    assert snapshot() == before


def test_bad_json_on_modify_changes_nothing(client, existing):
    tool_call_id, before = existing
    assert_error(client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH, data="{nope"), 400, "bad_json")
    assert snapshot() == before


# -- 401 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-token"},
                                     {"Authorization": "Basic dGVzdC10b2tlbg=="}, {"Authorization": "Bearer "}])
def test_missing_or_wrong_token_is_401(client, existing, headers):
    _, before = existing
    answer = client.post("/voice-tools/pending", headers=headers, json=BODY)
    assert_error(answer, 401, "unauthorized")
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert snapshot() == before


@pytest.mark.parametrize("path", ["/voice-tools/status/x", "/voice-tools/context/s", "/voice-tools/tools",
                                  "/readyz", "/metrics", "/openapi.json", "/get-session-context", "/nowhere"])
def test_every_endpoint_but_healthz_needs_the_token(client, path):
    assert_error(client.get(path), 401, "unauthorized")


def test_healthz_is_open(client):
    answer = client.get("/healthz")
    assert answer.status_code == 200 and answer.get_json()["status"] == "ok"


def test_caller_is_the_tokens_name(client, monkeypatch):
    import hashlib

    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", "alice:token-a, bare-token-b")
    first = client.post("/voice-tools/pending", headers={"Authorization": "Bearer token-a"}, json=BODY)
    second = client.post("/voice-tools/pending", headers={"Authorization": "Bearer bare-token-b"}, json=BODY)
    assert first.status_code == second.status_code == 201
    assert row(first.get_json()["tool_call_id"]).caller == "alice"
    assert row(second.get_json()["tool_call_id"]).caller == hashlib.sha256(b"bare-token-b").hexdigest()[:8]
    assert_error(client.post("/voice-tools/pending", headers=AUTH, json=BODY), 401, "unauthorized")


LONG_NAME = "n" * 101


def test_a_token_named_past_100_characters_is_refused_clearly_and_records_nothing(client, monkeypatch):
    """The caller column holds 100 characters; such a token is a configuration error
    the presenter is told about (401), never a database error (500) and never a truncated caller."""
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN},{LONG_NAME}:long-token,{'m' * 100}:ok-token")
    body = assert_error(pending(client, BODY, headers={"Authorization": "Bearer long-token"}), 401, "unauthorized")
    assert "longer than 100 characters" in body["message"] and "VOICE_TOOLS_API_TOKENS" in body["message"]
    assert call_count() == 0
    fine = pending(client, BODY, headers={"Authorization": "Bearer ok-token"})  # exactly 100 is a name
    assert fine.status_code == 201, fine.get_json()
    assert row(fine.get_json()["tool_call_id"]).caller == "m" * 100


# -- 404 / 405 -----------------------------------------------------------------------------

@pytest.mark.parametrize("method, path, kwargs", [
    ("get", "/voice-tools/status/tc_000000000000", {}),
    ("patch", "/voice-tools/modify/tc_000000000000", {"json": {"parameters": {"subject": "x"}}}),
    ("post", "/voice-tools/confirm/tc_000000000000", {}),
    ("post", "/voice-tools/resume/tc_000000000000", {"json": {"action": "proceed"}}),
    ("delete", "/voice-tools/cancel/tc_000000000000", {}),
])
def test_unknown_id_is_404(client, existing, method, path, kwargs):
    _, before = existing
    body = assert_error(getattr(client, method)(path, headers=AUTH, **kwargs), 404, "not_found")
    assert body["details"]["tool_call_id"] == "tc_000000000000"
    assert snapshot() == before


def test_unknown_path_and_session_context_are_404(client, existing):
    _, before = existing
    assert_error(client.get("/voice-tools/nothing-here", headers=AUTH), 404, "not_found")
    body = assert_error(client.get("/voice-tools/session-context?session_id=s&context_key=k", headers=AUTH),
                        404, "not_found")
    assert body["message"] == "Not found or expired"
    assert snapshot() == before


def test_wrong_method_is_405(client, existing):
    _, before = existing
    answer = client.get("/voice-tools/pending", headers=AUTH)
    body = assert_error(answer, 405, "method_not_allowed")
    assert "POST" in body["details"]["allowed"]
    assert_error(client.put(f"/voice-tools/cancel/{existing[0]}", headers=AUTH), 405, "method_not_allowed")
    assert snapshot() == before


# -- 409 -----------------------------------------------------------------------------------

def _executing(tool_call_id: str) -> None:
    with db.session() as s:
        lifecycle.confirm(s, tool_call_id)


def test_confirm_twice_is_409_invalid_status(client):
    tool_call_id = created_id(client)
    _executing(tool_call_id)
    before = snapshot()
    body = assert_error(client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH), 409, "invalid_status")
    assert body["details"]["status"] == "EXECUTING"
    assert "EXECUTING" in body["message"]
    assert snapshot() == before


def test_modify_after_confirm_is_409_naming_the_status(client):
    tool_call_id = created_id(client)
    _executing(tool_call_id)
    before = snapshot()
    answer = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH, json={"parameters": {"to": "x@example.com"}})
    body = assert_error(answer, 409, "invalid_status")
    assert body["details"]["status"] == "EXECUTING"
    assert snapshot() == before


def test_resume_a_pending_call_is_409(client, existing):
    tool_call_id, before = existing
    body = assert_error(client.post(f"/voice-tools/resume/{tool_call_id}", headers=AUTH, json={"action": "proceed"}),
                        409, "invalid_status")
    assert body["details"]["status"] == "PENDING"
    assert snapshot() == before


def test_cancel_twice_is_409_already_terminal(client, existing):
    tool_call_id, _ = existing
    assert client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH).status_code == 200
    before = snapshot()
    body = assert_error(client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH), 409, "already_terminal")
    assert body["details"]["status"] == "CANCELLED"
    assert snapshot() == before


def test_cancel_after_point_of_no_return_is_409_too_late(client, existing):
    tool_call_id, _ = existing
    _executing(tool_call_id)
    with db.session() as s:
        assert lifecycle.commit_point(s, tool_call_id, "SENDING") is not None
    before = snapshot()
    body = assert_error(client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH), 409, "too_late")
    assert body["details"]["status"] == "EXECUTING"
    assert snapshot() == before


# -- idempotency ---------------------------------------------------------------------------

def test_replay_with_same_key_is_200_same_body_no_new_row(client):
    first = pending(client, {**BODY, "idempotency_key": "key-1"})
    assert first.status_code == 201
    before = snapshot()
    again = pending(client, {**BODY, "idempotency_key": "key-1"})
    assert again.status_code == 200
    assert again.get_json() == first.get_json()
    assert snapshot() == before and call_count() == 1


def test_replay_with_header_key(client):
    first = pending(client, BODY, headers={**AUTH, "Idempotency-Key": "hdr-1"})
    again = pending(client, BODY, headers={**AUTH, "Idempotency-Key": "hdr-1"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.get_json()["tool_call_id"] == first.get_json()["tool_call_id"]
    assert row(first.get_json()["tool_call_id"]).idempotency_key == "hdr-1"
    assert call_count() == 1


def test_same_key_other_content_is_409(client):
    assert pending(client, {**BODY, "idempotency_key": "key-2"}).status_code == 201
    before = snapshot()
    other = {**BODY, "parameters": {"to": "someone@example.com", "subject": "Test"}, "idempotency_key": "key-2"}
    body = assert_error(pending(client, other), 409, "idempotency_conflict")
    assert body["details"]["status"] == "PENDING"
    assert snapshot() == before


def test_execute_replay_starts_nothing_new(client, worker):
    first = client.post("/voice-tools/execute?wait=10", headers=AUTH, json={**BODY, "idempotency_key": "ex-1"})
    assert first.status_code == 200 and first.get_json()["status"] == "PREPARED"
    before = snapshot()
    again = client.post("/voice-tools/execute", headers=AUTH, json={**BODY, "idempotency_key": "ex-1"})
    assert again.status_code == 200
    assert again.get_json()["status"] == "PREPARED"
    assert again.get_json()["tool_call_id"] == first.get_json()["tool_call_id"]
    assert again.get_json()["current_step"] == "READY_TO_SEND"
    assert snapshot() == before


def test_a_key_used_on_pending_then_replayed_on_execute_is_409_and_starts_nothing(client, worker):
    """A key is bound to the kind of request that first used it (docs/promises.md, Idempotency):
    the /pending call was never confirmed, so an /execute replay of it must not start it."""
    first = pending(client, {**BODY, "idempotency_key": "kind-1"})
    assert first.status_code == 201
    before = snapshot()
    body = assert_error(client.post("/voice-tools/execute", headers=AUTH, json={**BODY, "idempotency_key": "kind-1"}),
                        409, "idempotency_conflict")
    assert body["details"]["status"] == "PENDING"
    assert body["details"]["tool_call_id"] == first.get_json()["tool_call_id"]
    assert "/pending" in body["message"]
    assert snapshot() == before
    assert row(first.get_json()["tool_call_id"]).request_kind == "pending"
    # the legacy alias is an /execute too
    flat = {"session_id": "test_123", "to": GUIDE_EMAIL["to"], "subject": GUIDE_EMAIL["subject"]}
    answer = client.post("/execute-gmail", headers={**AUTH, "Idempotency-Key": "kind-1"}, json=flat)
    assert_error(answer, 409, "idempotency_conflict")
    assert snapshot() == before


def test_a_key_used_on_execute_then_replayed_on_pending_is_409(client, broker_down):
    """The other way round: the call was started (here: recorded, its start refused by the broker);
    a /pending replay would answer a PENDING call waiting for a confirm the caller already gave."""
    assert_error(client.post("/voice-tools/execute", headers=AUTH, json={**BODY, "idempotency_key": "kind-2"}),
                 503, "unavailable")
    before = snapshot()
    assert [c["request_kind"] for c in before["tool_calls"]] == ["execute"]
    assert_error(pending(client, {**BODY, "idempotency_key": "kind-2"}), 409, "idempotency_conflict")
    assert snapshot() == before


# -- 413 -----------------------------------------------------------------------------------

def test_body_over_256_kib_is_413(client, existing):
    _, before = existing
    big = {**BODY, "parameters": {**GUIDE_EMAIL, "body": "x" * (256 * 1024)}}
    body = assert_error(pending(client, big), 413, "too_large")
    assert body["details"]["max_bytes"] == 256 * 1024
    assert snapshot() == before


# -- 422 -----------------------------------------------------------------------------------

def _fields(body: dict) -> dict:
    return body["details"]["fields"]


def test_unknown_tool_lists_the_known_ones(client, existing):
    _, before = existing
    body = assert_error(pending(client, {**BODY, "function": "launch_rocket"}), 422, "validation_error")
    assert "launch_rocket" in _fields(body)["function"][0]
    assert body["details"]["known_tools"] == tools.names() and "send_email" in tools.names()
    assert "send_email" in _fields(body)["function"][0]
    assert snapshot() == before


@pytest.mark.parametrize("change, field", [
    ({"session_id": None}, "session_id"),
    ({"session_id": "a b"}, "session_id"),
    ({"session_id": "x" * 101}, "session_id"),
    ({"session_id": "ok\x00"}, "session_id"),
    ({"tool_call_id": "tc 1"}, "tool_call_id"),
    ({"tool_call_id": "t" * 101}, "tool_call_id"),
    ({"intent_id": "i" * 101}, "intent_id"),
    ({"callback_url": "http://evil.example.com/hook"}, "callback_url"),
    ({"callback_url": "file:///etc/passwd"}, "callback_url"),
    ({"status": "COMPLETED"}, "status"),
    ({"surprise": 1}, "surprise"),
    ({"parameters": {"to": "not-an-email", "subject": "Test"}}, "parameters"),
    ({"parameters": {"to": "a@example.com"}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "bcc": "x@example.com"}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "body": "hello\x00world"}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "body": "bell\x07"}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "subject": "delete\x7f"}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "subject": "next line\x85"}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "subject": "csi\x9b31m"}}, "parameters"),
    ({"session_id": "ok\x80"}, "session_id"),
    ({"parameters": {**GUIDE_EMAIL, "body": "lone \ud800 surrogate"}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "cc": ["a@example.com", "b\x1b@example.com"]}}, "parameters"),
    ({"parameters": {**GUIDE_EMAIL, "reference_context": "last_query_results"}}, "parameters"),
    ({"parameters": "not an object"}, "parameters"),
    ({"function": "send_email", "function_name": "query_vector_db"}, "function_name"),
])
def test_invalid_fields_are_422_naming_the_field(client, existing, change, field):
    _, before = existing
    payload = {**BODY, **change}
    payload = {key: value for key, value in payload.items() if value is not None}
    body = assert_error(pending(client, payload), 422, "validation_error")
    assert field in _fields(body), body
    assert snapshot() == before


# whitespace and control characters a URI never holds (RFC 3986): each one, in the path, the query, the host
NOT_IN_A_URI = ["http://127.0.0.1:9/cb\r\nX-Injected: yes", "http://127.0.0.1:9/cb\n", "http://127.0.0.1:9/c b",
                "http://127.0.0.1:9/cb\t", "http://127.0.0.1:9/cb?x=\r", "http://127.0.0.1:9/cb\x7f",
                "http://127.0.0.1:9/cb\x85", "http://127.0.0.1:9/cb\u2028", " http://127.0.0.1:9/cb",
                "http://127.0.0.1:9/cb\u00a0"]


@pytest.mark.parametrize("url", NOT_IN_A_URI)
def test_a_callback_url_with_whitespace_or_a_control_character_is_422_naming_it_on_every_door(client, existing, url):
    tool_call_id, before = existing
    doors = [
        ("post", "/voice-tools/pending", {**BODY, "callback_url": url}, "callback_url"),
        ("post", "/voice-tools/execute", {**BODY, "callback_urls": {"completed": url}}, "callback_urls"),
        ("post", f"/voice-tools/confirm/{tool_call_id}", {"callback_url": url}, "callback_url"),
        ("post", "/webhook/voice-tools/pending", {**BODY, "callback_urls": {"progress": url}}, "callback_urls"),
        ("post", "/webhook/execute-gmail", {"session_id": "s", "to": "john@example.com", "subject": "Hi",
                                            "callback_url": url}, "callback_url"),
    ]
    for method, path, payload, field in doors:
        body = assert_error(getattr(client, method)(path, headers=AUTH, json=payload), 422, "validation_error")
        assert field in _fields(body), (path, body)
        said = str(_fields(body)[field])
        assert "whitespace or control characters" in said, (path, body)
    assert snapshot() == before


def test_a_clean_callback_url_is_still_taken_as_given(client):
    url = "http://127.0.0.1:9/cb/%0D%0A?x=a%20b&y=~"  # percent-encoded, as a URI carries them
    answer = pending(client, {**BODY, "callback_url": url})
    assert answer.status_code == 201, answer.get_json()
    assert row(answer.get_json()["tool_call_id"]).callback_url == url


@pytest.mark.parametrize("text, key", [
    ('{"session_id": "a", "function": "send_email", "session_id": "b", "parameters": {"to": "j@example.com", '
     '"subject": "Hi"}}', "session_id"),
    ('{"session_id": "a", "function": "send_email", "parameters": {"to": "j@example.com", "subject": "Hi", '
     '"to": "k@example.com"}}', "to"),
    ('{"session_id": "a", "function": "send_email", "parameters": {"to": "j@example.com", "subject": "Hi"}, '
     '"callback_urls": {"completed": "http://127.0.0.1:9/a", "completed": "http://127.0.0.1:9/b"}}', "completed"),
])
def test_a_key_given_twice_in_a_body_is_400_naming_it(client, existing, text, key):
    """A proxy or a signer that reads the first of two keys must not see another request than the one run."""
    tool_call_id, before = existing
    for path in ("/voice-tools/pending", "/webhook/voice-tools/execute"):
        body = assert_error(client.post(path, headers=AUTH, data=text), 400, "bad_json")
        assert body["details"] == {"key": key}, body
        assert repr(key) in body["message"], body
    patched = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                           data='{"parameters": {"subject": "a", "subject": "b"}}')
    assert assert_error(patched, 400, "bad_json")["details"] == {"key": "subject"}
    assert snapshot() == before


def test_nested_control_character_names_the_nested_field(client, existing):
    _, before = existing
    payload = {"session_id": "s", "function": "query_vector_db",
               "parameters": {"user_query": "q", "structured_query": {"filters": {"region\x00": "x", "ok": "\x01"}}}}
    body = assert_error(pending(client, payload), 422, "validation_error")
    filters = _fields(body)["parameters"]["structured_query"]["filters"]
    assert "ok" in filters and "region\\x00" in filters
    assert snapshot() == before


def test_tabs_and_newlines_are_allowed(client):
    answer = pending(client, {**BODY, "parameters": {**GUIDE_EMAIL, "body": "Hi,\n\tline two\r\n"}})
    assert answer.status_code == 201
    assert row(answer.get_json()["tool_call_id"]).parameters["body"] == "Hi,\n\tline two\r\n"


@pytest.mark.parametrize("path", ["/voice-tools/status/bad%00id", "/voice-tools/status/has%20space",
                                  "/voice-tools/status/" + "x" * 101])
def test_bad_tool_call_id_in_path_is_422(client, existing, path):
    _, before = existing
    body = assert_error(client.get(path, headers=AUTH), 422, "validation_error")
    assert "tool_call_id" in _fields(body)
    assert snapshot() == before


@pytest.mark.parametrize("patch, field", [
    ({"parameters": {"to": "not-an-email"}}, "parameters"),
    ({"parameters": {"subject": None}}, "parameters"),
    ({"parameters": {"unknown": "x"}}, "parameters"),
    ({"parameters": {"reference_context": "nothing_stored"}}, "parameters"),
    ({"parameters": {"to": "a@example.com"}, "status": "COMPLETED"}, "status"),
    ({"parameters": {"to": "a@example.com"}, "session_id": "other"}, "session_id"),
    ({"parameters": {"to": "a@example.com"}, "function": "query_vector_db"}, "function"),
    ({}, "parameters"),
    ({"parameters": {"body": "nul\x00"}}, "parameters"),
])
def test_invalid_modify_is_422_and_changes_nothing(client, existing, patch, field):
    tool_call_id, before = existing
    body = assert_error(client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH, json=patch),
                        422, "validation_error")
    assert field in _fields(body), body
    assert snapshot() == before


@pytest.mark.parametrize("method, path, kwargs, field", [
    ("post", "/voice-tools/confirm/{id}?wait=0", {}, "wait"),
    ("post", "/voice-tools/confirm/{id}?wait=31", {}, "wait"),
    ("post", "/voice-tools/confirm/{id}?wait=soon", {}, "wait"),
    ("post", "/voice-tools/confirm/{id}", {"json": {"callback_url": "http://203.0.113.9/x"}}, "callback_url"),
    ("post", "/voice-tools/confirm/{id}", {"json": {"status": "EXECUTING"}}, "status"),
    ("post", "/voice-tools/resume/{id}", {"json": {"action": "jump"}}, "action"),
    ("post", "/voice-tools/resume/{id}", {"json": {}}, "action"),
    ("delete", "/voice-tools/cancel/{id}", {"json": {"reason": "x\x00"}}, "reason"),
    ("delete", "/voice-tools/cancel/{id}?reason=a%C2%9B", {}, "reason"),
    ("delete", "/voice-tools/cancel/{id}?reason=a%7F", {}, "reason"),
    ("delete", "/voice-tools/cancel/{id}", {"json": {"reason": "x\x9f"}}, "reason"),
    ("delete", "/voice-tools/cancel/{id}", {"json": {"why": "x"}}, "why"),
    ("get", "/voice-tools/context/test_123?limit=0", {}, "limit"),
    ("get", "/voice-tools/context/test_123?limit=101", {}, "limit"),
    ("get", "/voice-tools/context/bad%20session", {}, "session_id"),
    ("get", "/voice-tools/tools?format=xml", {}, "format"),
    ("get", "/voice-tools/session-context?session_id=s", {}, "context_key"),
    ("post", "/execute-gmail", {"json": {"session_id": "s", "to": "a@example.com"}}, "subject"),
])
def test_invalid_request_is_422(client, existing, method, path, kwargs, field):
    tool_call_id, before = existing
    answer = getattr(client, method)(path.format(id=tool_call_id), headers=AUTH, **kwargs)
    body = assert_error(answer, 422, "validation_error")
    assert field in _fields(body), body
    assert snapshot() == before


def test_idempotency_key_body_and_header_must_agree(client):
    answer = pending(client, {**BODY, "idempotency_key": "a"}, headers={**AUTH, "Idempotency-Key": "b"})
    assert "idempotency_key" in _fields(assert_error(answer, 422, "validation_error"))
    assert call_count() == 0


# -- 503 -----------------------------------------------------------------------------------

def test_broker_down_on_confirm_is_503_and_the_call_is_pending_again(client, existing, broker_down):
    tool_call_id, before = existing
    body = assert_error(client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH), 503, "unavailable")
    assert body["details"]["service"] == "broker"
    stored = row(tool_call_id)
    assert stored.status == "PENDING"
    assert [h["status"] for h in stored.status_history] == ["PENDING", "EXECUTING", "PENDING"]
    assert stored.confirmed_at is None and stored.workflow_id is None


def test_broker_down_makes_readyz_503(client, broker_down):
    body = assert_error(client.get("/readyz", headers=AUTH), 503, "unavailable")
    assert body["details"]["down"] == ["broker"]


def test_database_down_is_503(client, existing, database_down):
    tool_call_id, _ = existing
    with database_down():
        body = assert_error(client.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH), 503, "unavailable")
        assert body["details"]["service"] == "database"
        ready = assert_error(client.get("/readyz", headers=AUTH), 503, "unavailable")
        assert ready["details"]["down"] == ["database"]
        assert_error(pending(client), 503, "unavailable")
    assert snapshot() == existing[1]


def test_broker_down_on_execute_leaves_a_pending_call_that_a_replay_starts(client, worker, broker_down):
    body = {**BODY, "idempotency_key": "ex-down"}
    answer = client.post("/voice-tools/execute", headers=AUTH, json=body)
    assert_error(answer, 503, "unavailable")
    [stored] = snapshot()["tool_calls"]
    assert stored["status"] == "PENDING"
    assert [h["status"] for h in stored["status_history"]] == ["PENDING", "EXECUTING", "PENDING"]
    broker_down.restore()
    again = client.post("/voice-tools/execute?wait=10", headers=AUTH, json=body)
    assert again.status_code == 200, again.get_json()
    assert again.get_json()["tool_call_id"] == stored["tool_call_id"]
    assert again.get_json()["status"] == "PREPARED"
    assert call_count() == 1


def test_broker_down_on_resume_is_503_and_the_call_stays_prepared(client, existing, broker_down):
    tool_call_id, _ = existing
    with db.session() as s:
        lifecycle.confirm(s, tool_call_id)
        lifecycle.checkpoint(s, tool_call_id, "READY_TO_SEND", 0.25)
    answer = client.post(f"/voice-tools/resume/{tool_call_id}", headers=AUTH, json={"action": "proceed"})
    assert assert_error(answer, 503, "unavailable")["details"]["service"] == "broker"
    stored = row(tool_call_id)
    assert stored.status == "PREPARED" and stored.committed_at is None
    assert [h["status"] for h in stored.status_history][-3:] == ["PREPARED", "EXECUTING", "PREPARED"]


def _chunked(data: bytes, size: int = 16 * 1024):
    """The body as a generator: requests sends it with Transfer-Encoding: chunked, no Content-Length."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


def test_a_chunked_body_over_256_kib_is_413_over_real_http(api_url):
    """Without Content-Length the body is counted as it comes, never cut silently."""
    import json

    import requests

    big = json.dumps({**BODY, "parameters": {**GUIDE_EMAIL, "body": "x" * 300_000}}).encode()
    answer = requests.post(f"{api_url}/voice-tools/pending", headers=AUTH, data=_chunked(big), timeout=30)
    assert answer.request.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in answer.request.headers
    assert (answer.status_code, answer.json()["error"]) == (413, "too_large"), answer.text
    assert answer.json()["details"]["max_bytes"] == 256 * 1024
    padded = json.dumps(BODY).encode() + b" " * (300 * 1024)  # a small call padded past the limit
    answer = requests.post(f"{api_url}/voice-tools/pending", headers=AUTH, data=_chunked(padded), timeout=30)
    assert (answer.status_code, answer.json()["error"]) == (413, "too_large"), answer.text
    assert call_count() == 0
    small = json.dumps(BODY).encode() + b" " * 1024  # under the limit, chunked, is fine
    answer = requests.post(f"{api_url}/voice-tools/pending", headers=AUTH, data=_chunked(small), timeout=30)
    assert answer.status_code == 201, answer.text
    assert call_count() == 1


@pytest.fixture
def vanished_tool():
    """A call of a tool this server no longer runs (removed since the call was recorded, or a
    process of an older release behind the same load balancer)."""
    from marshmallow import Schema, fields

    from tasks import chains
    from tasks.tools import Step, Tool
    from tests.helpers import make_call

    class Thing(Schema):
        what = fields.String(required=True)

    tool = Tool(name="retired_tool", description="A tool that is about to be removed.", schema=Thing,
                action_level="write", steps=(Step("READY", checkpoint=True), Step("APPLY", side_effect=True),
                                             Step("COMPLETED")),
                result=lambda outputs: {}, confirmation_message="Do {what}?", start_message="Doing {what}.",
                modified_message="Now {what}?", voice_response="Did {what}.",
                failure_response="The {what} did not happen.", cancelled_response="Cancelled.")
    chains.register_tool(tool)
    try:
        pending_call = make_call(tool.name, {"what": "a transfer"}).tool_call_id
        prepared_call = make_call(tool.name, {"what": "a refund"}).tool_call_id
        with db.session() as s:
            lifecycle.confirm(s, prepared_call)
            lifecycle.checkpoint(s, prepared_call, "READY", 0.33)
    finally:
        chains.unregister_tool(tool.name)
    return pending_call, prepared_call


def test_a_call_of_a_tool_no_longer_run_here_is_refused_and_left_as_it_was(client, vanished_tool):
    """A tool found unknown is refused before the confirm's or resume's transition: 422 naming
    the known tools, and the call stays as it was (never EXECUTING with no chain)."""
    pending_call, prepared_call = vanished_tool
    before = snapshot()
    for path, body in ((f"/voice-tools/confirm/{pending_call}", None),
                       (f"/voice-tools/resume/{prepared_call}", {"action": "proceed"})):
        answer = client.post(path, headers=AUTH, json=body)
        error = assert_error(answer, 422, "validation_error")
        assert "retired_tool" in error["details"]["fields"]["function_name"][0]
        assert error["details"]["known_tools"] == tools.names()
    assert snapshot() == before
    assert row(pending_call).status == "PENDING" and row(prepared_call).status == "PREPARED"
    # what is left to do with such a call works: cancel it
    answer = client.delete(f"/voice-tools/cancel/{pending_call}", headers=AUTH)
    assert answer.status_code == 200 and row(pending_call).status == "CANCELLED"
