"""/openapi.json as third-party tools read it: the document validates (``openapi-spec-validator``),
it describes every event (one schema per kind, the callbacks of every operation that takes a
callback URL, the signature headers, the event stream's frames), and the bodies voice-tools
really sends, by callback and on the stream, match those schemas (``openapi-schema-validator``)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from openapi_schema_validator import OAS30Validator
from openapi_spec_validator import validate

from models import db, events, lifecycle
from tasks import chains, tools
from tasks.calls import actions, schemas
from tests.conftest import API_TOKEN, AUTH
from tests.helpers import make_call, wait_status
from support.sse_client import Stream

TRACED = {"trace_id", "span_id"}  # only when the server traces (tests/test_tracing.py sees them)


@pytest.fixture
def document(client):
    answer = client.get("/openapi.json", headers=AUTH)
    assert answer.status_code == 200
    return answer.get_json()


def test_the_document_validates(document):
    validate(document)  # raises on an invalid document
    assert document["openapi"] == "3.0.3"


def _schema_of(document: dict, name: str) -> OAS30Validator:
    """A validator for the component ``name``, its references resolved within the document."""
    return OAS30Validator({**document, "$ref": f"#/components/schemas/{name}"})


def test_every_event_kind_has_its_schema_and_the_callbacks_carry_them(document):
    components = document["components"]
    union = components["schemas"]["CallbackEvent"]
    assert union["discriminator"]["propertyName"] == "event"
    mapping = union["discriminator"]["mapping"]
    assert list(mapping) == list(events.KINDS) == ["progress", "checkpoint", "completed", "failed", "cancelled",
                                                   "expired"]
    assert [ref["$ref"] for ref in union["oneOf"]] == list(mapping.values())
    for kind, ref in mapping.items():
        schema = components["schemas"][ref.rsplit("/", 1)[1]]
        assert schema["properties"]["event"]["enum"] == [kind]
        assert schema["properties"]["status"]["enum"] == [events.STATUS_OF[kind]]
        assert "event" in schema["required"] and "sent_at" not in schema["required"]
        assert schema["description"]
    assert {"checkpoint", "resume_webhook"} <= set(components["schemas"]["CheckpointEvent"]["required"])
    assert "checkpoint" not in components["schemas"]["ProgressEvent"]["properties"]

    # every operation that takes a callback URL names the callbacks it makes; the others none
    taking = {(method, path) for path, item in document["paths"].items() for method, operation in item.items()
              if "callbacks" in operation}
    for path in ("/voice-tools/pending", "/voice-tools/execute", "/voice-tools/confirm/{tool_call_id}",
                 "/execute-gmail", "/query-vector-db"):
        assert ("post", path) in taking, path
    assert ("post", "/voice-tools/resume/{tool_call_id}") not in taking
    assert ("post", "/voice-tools/modify/{tool_call_id}") not in taking
    made = document["paths"]["/voice-tools/pending"]["post"]["callbacks"]["events"]
    for method, path in taking:
        assert document["paths"][path][method]["callbacks"] == {"events": made}
    assert set(made) == {"{$request.body#/callback_url}"} | {f"{{$request.body#/callback_urls/{kind}}}"
                                                              for kind in events.KINDS}
    assert made["{$request.body#/callback_url}"]["post"]["requestBody"]["content"]["application/json"][
        "schema"] == {"$ref": "#/components/schemas/CallbackEvent"}
    assert made["{$request.body#/callback_urls/checkpoint}"]["post"]["requestBody"]["content"]["application/json"][
        "schema"] == {"$ref": "#/components/schemas/CheckpointEvent"}
    # the signature headers of both schemes
    headers = {components["parameters"][ref["$ref"].rsplit("/", 1)[1]]["name"]
               for ref in made["{$request.body#/callback_url}"]["post"]["parameters"]}
    assert headers == {"webhook-id", "webhook-timestamp", "webhook-signature", "X-Voice-Tools-Event",
                       "X-Voice-Tools-Event-Id", "X-Voice-Tools-Timestamp", "X-Voice-Tools-Signature"}
    answer = made["{$request.body#/callback_url}"]["post"]["responses"]["200"]["content"]["application/json"]
    assert answer["schema"] == {"$ref": "#/components/schemas/EventAnswer"}

    # the event stream's frames: event: <kind>, id:, data: (the same body), retry:
    stream = document["paths"]["/voice-tools/events/{session_id}"]["get"]["responses"]["200"]
    frame = stream["content"]["text/event-stream"]["schema"]
    assert frame["properties"]["event"]["enum"] == list(events.KINDS)
    assert {"id", "event", "data", "retry"} <= set(frame["properties"])
    assert frame["properties"]["data"]["x-json-schema"] == {"$ref": "#/components/schemas/CallbackEvent"}
    assert "Browsers are not served" in stream["description"]


def _every_kind_of_event(relay) -> list[str]:
    """Calls that, between them, send one event of every kind to ``relay``; their ids."""
    done = make_call(callback_url=relay.url, session_id="sess_kinds")  # progress, checkpoint, completed
    actions.confirm(done.tool_call_id)
    wait_status(done.tool_call_id, "PREPARED")
    actions.resume(done.tool_call_id)
    relay.wait_for(done.tool_call_id, "completed")
    cancelled = make_call(callback_url=relay.url, session_id="sess_kinds")
    actions.cancel(cancelled.tool_call_id, "changed my mind", deliver_now=True)
    relay.wait_for(cancelled.tool_call_id, "cancelled")
    expired = make_call(callback_url=relay.url, session_id="sess_kinds")
    assert actions.expire(expired.tool_call_id, pending_ttl_s=0, prepared_ttl_s=0) is not None
    relay.wait_for(expired.tool_call_id, "expired")
    failed = make_call(callback_url=relay.url, session_id="sess_kinds")
    with db.session() as s:
        lifecycle.confirm(s, failed.tool_call_id)
    chains.fail_call(tools.get("send_email"), failed.tool_call_id, "the account is closed", failed.parameters,
                     step="PREPARING", gate=1)
    relay.wait_for(failed.tool_call_id, "failed")
    return [done.tool_call_id, cancelled.tool_call_id, expired.tool_call_id, failed.tool_call_id]


def test_every_callback_body_matches_its_kinds_schema(worker, relay, document):
    _every_kind_of_event(relay)
    union = _schema_of(document, "CallbackEvent")
    assert {event["event"] for event in relay.events} == set(events.KINDS)
    for event in relay.events:
        union.validate(event)  # raises when it does not match
        kind = schemas.EVENT_SCHEMAS[event["event"]].__name__
        _schema_of(document, kind).validate(event)
        described = document["components"]["schemas"][kind]
        assert set(event) == set(described["properties"]) - TRACED, set(event) ^ set(described["properties"])
        for other in set(events.KINDS) - {event["event"]}:  # the discriminator's other branches refuse it
            assert not _schema_of(document, schemas.EVENT_SCHEMAS[other].__name__).is_valid(event)


def test_every_stream_frame_matches_its_kinds_schema(worker, relay, document, api_url):
    calls = _every_kind_of_event(relay)
    stream = Stream(f"{api_url}/voice-tools/events/sess_kinds", AUTH)
    frames = [stream.next_event() for _ in range(len(relay.events))]
    stream.close()
    assert sorted(event_id for event_id, _ in frames) == sorted(event["event_id"] for event in relay.events)
    union = _schema_of(document, "CallbackEvent")
    for (event_id, data), kind in zip(frames, stream.kinds):
        assert data["event"] == kind and data["event_id"] == event_id and data["tool_call_id"] in calls
        union.validate(data)
        described = document["components"]["schemas"][schemas.EVENT_SCHEMAS[kind].__name__]
        assert set(data) == set(described["properties"]) - {"sent_at"} - TRACED  # sent_at: callbacks only


# -- operations: ids, typed bodies ---------------------------------------------------------------

def test_every_operation_has_a_unique_operation_id(document):
    ids = [(operation.get("operationId"), method, path) for path, item in document["paths"].items()
           for method, operation in item.items()]
    assert all(re.fullmatch(r"[a-z][A-Za-z0-9]*", operation_id or "") for operation_id, _, _ in ids), ids
    assert len({operation_id for operation_id, _, _ in ids}) == len(ids)
    named = {(method, path): operation_id for operation_id, method, path in ids}
    assert named[("post", "/voice-tools/pending")] == "pending"
    assert named[("post", "/webhook/voice-tools/pending")] == "webhookPending"
    assert named[("get", "/voice-tools/session-context")] == "sessionContext"


TAGS = {"calls", "tools", "events", "meta"}
LEGACY = {"/execute-gmail", "/query-vector-db", "/get-session-context"}  # the n8n workflows' endpoint names


def test_every_operation_is_grouped_by_one_tag_and_the_compatibility_doors_are_deprecated(document):
    """A generated client groups operations by tag: ``calls.confirm``, with ``calls.webhook_confirm`` beside
    it marked deprecated, never a ``default`` group."""
    assert {tag["name"] for tag in document["tags"]} == TAGS and all(tag["description"] for tag in document["tags"])
    tagged = {(method, path): operation.get("tags") for path, item in document["paths"].items()
              for method, operation in item.items()}
    assert all(tags is not None and len(tags) == 1 and tags[0] in TAGS for tags in tagged.values()), tagged
    for path, item in document["paths"].items():
        for method, operation in item.items():
            compatible = path.startswith("/webhook/") or path in LEGACY
            assert operation.get("deprecated", False) is compatible, (method, path)
            if path.startswith("/webhook/"):  # an alias: grouped with what it stands for
                canonical = operation["x-alias-of"]
                assert operation["tags"] == document["paths"][canonical][method]["tags"], (method, path)
            if compatible:  # it names what new relays use: an operation of the document, not deprecated
                named = [p for p in re.findall(r"/[\w\-/{}]+", operation["description"]) if p in document["paths"]]
                assert named and not document["paths"][named[0]][method].get("deprecated"), operation
    assert tagged[("post", "/voice-tools/confirm/{tool_call_id}")] == ["calls"]
    assert tagged[("post", "/webhook/resume-execution/{tool_call_id}")] == ["calls"]
    assert tagged[("get", "/voice-tools/tools")] == ["tools"]
    assert tagged[("get", "/voice-tools/events/{session_id}")] == ["events"]
    assert {tagged[("get", path)][0] for path in ("/healthz", "/readyz", "/metrics", "/openapi.json")} == {"meta"}


def test_the_document_needs_the_token_as_the_readme_says(client):
    """Like every path but /healthz, the document is the token's: the README says so where it names it."""
    refused = client.get("/openapi.json")
    assert refused.status_code == 401 and refused.get_json()["error"] == "unauthorized"
    assert client.get("/openapi.json", headers=AUTH).status_code == 200
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("|") and "/openapi.json" in line.split("|")[1]]
    assert len(rows) == 2 and all("token" in line for line in rows), rows  # where it is served; the pages


def test_pending_and_execute_take_one_typed_body_per_tool_chosen_by_function(document):
    schemas_ = document["components"]["schemas"]
    union = schemas_["PendingRequest"]
    assert union["discriminator"]["propertyName"] == "function"
    mapping = union["discriminator"]["mapping"]
    assert list(mapping) == tools.names()
    assert [ref["$ref"] for ref in union["oneOf"]] == list(mapping.values())
    for name, ref in mapping.items():
        variant = schemas_[ref.rsplit("/", 1)[1]]
        assert variant["properties"]["function"]["enum"] == [name] and "function" in variant["required"]
        assert variant["properties"]["parameters"]["allOf"] == [
            {"$ref": f"#/components/schemas/{tools.TOOLS[name].schema.__name__}"}]  # the registry's schema
    for path in ("/voice-tools/pending", "/voice-tools/execute"):
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/PendingRequest"}


def test_callback_url_fields_are_described_apart(document):
    schemas_ = document["components"]["schemas"]
    described = {kind: schemas_["CallbackUrls"]["properties"][kind]["description"] for kind in events.KINDS}
    assert len(set(described.values())) == len(events.KINDS)
    for kind, description in described.items():
        assert f"the call's {kind} events" in description
    general = schemas_["ConfirmRequest"]["properties"]["callback_url"]["description"]
    assert general not in described.values() and "callback_urls does not send elsewhere" in general


USE_THE_CLIENT = '''
from voice_tools_client import AuthenticatedClient
from voice_tools_client.api.calls import pending
from voice_tools_client.models import (PendingAnswer, PendingSendEmail, PendingSendEmailFunction,
                                       SendEmailParameters)


def record(base_url: str, token: str) -> PendingAnswer:
    client = AuthenticatedClient(base_url=base_url, token=token)
    body = PendingSendEmail(session_id="sess_generated", function=PendingSendEmailFunction.SEND_EMAIL,
                            parameters=SendEmailParameters(to="john@example.com", subject="Generated"))
    answer = pending.sync(client=client, body=body)
    assert isinstance(answer, PendingAnswer), answer
    return answer
'''

MISUSE_THE_CLIENT = '''
from voice_tools_client import AuthenticatedClient
from voice_tools_client.api.calls import pending
from voice_tools_client.models import PendingSendEmail, PendingSendEmailFunction, SearchContactsParameters

client = AuthenticatedClient(base_url="http://127.0.0.1", token="t")
pending.sync(client=client, body={"function": "send_email"})
PendingSendEmail(session_id="s", function=PendingSendEmailFunction.SEND_EMAIL,
                 parameters=SearchContactsParameters(name="John"))
'''


@pytest.mark.slow
def test_a_generated_python_client_types_the_calls_and_records_one(document, api_url, tmp_path, monkeypatch):
    """openapi-python-client turns the document into a client whose pending body is one type per tool:
    mypy accepts a well-typed call and refuses an untyped body or another tool's parameters, and the
    call works against the API."""
    spec = tmp_path / "openapi.json"
    spec.write_text(json.dumps(document))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    made = subprocess.run([str(bin_dir / "openapi-python-client"), "generate", "--path", str(spec), "--meta", "none",
                           "--output-path", str(tmp_path / "voice_tools_client")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "Warning" not in made.stdout + made.stderr, made.stdout + made.stderr
    groups = {path.name for path in (tmp_path / "voice_tools_client" / "api").iterdir() if path.is_dir()}
    assert groups == {"calls", "tools", "events", "meta"}, groups  # no "default"
    calls = {path.stem for path in (tmp_path / "voice_tools_client" / "api" / "calls").glob("*.py")}
    assert {"confirm", "webhook_confirm", "alias_send_email"} <= calls, calls
    alias = (tmp_path / "voice_tools_client" / "api" / "calls" / "webhook_confirm.py").read_text()
    assert "Kept so that a relay written for the n8n workflows works unchanged" in alias  # and what to use instead
    (tmp_path / "use_client.py").write_text(USE_THE_CLIENT)
    (tmp_path / "misuse_client.py").write_text(MISUSE_THE_CLIENT)

    def mypy(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                               "--cache-dir", str(tmp_path / ".mypy_cache"), name],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)

    typed = mypy("use_client.py")
    assert typed.returncode == 0, typed.stdout + typed.stderr
    misused = mypy("misuse_client.py")
    assert misused.returncode == 1, misused.stdout + misused.stderr
    assert 'Argument "body" to "sync" has incompatible type "dict[str, str]"' in misused.stdout, misused.stdout
    assert 'Argument "parameters" to "PendingSendEmail" has incompatible type "SearchContactsParameters"' \
        in misused.stdout, misused.stdout

    monkeypatch.syspath_prepend(str(tmp_path))
    from use_client import record

    answer = record(api_url, API_TOKEN)
    assert answer.status == "PENDING" and answer.function_name == "send_email"
    assert answer.tool_call_id.startswith("tc_")
