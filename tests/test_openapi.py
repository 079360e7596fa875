"""/openapi.json as third-party tools read it: the document validates (``openapi-spec-validator``),
it describes every event (one schema per kind, the callbacks of every operation that takes a
callback URL, the signature headers, the event stream's frames), and the bodies voice-tools
really sends, by callback and on the stream, match those schemas (``openapi-schema-validator``)."""
from __future__ import annotations

import pytest
from openapi_schema_validator import OAS30Validator
from openapi_spec_validator import validate

from models import db, events, lifecycle
from tasks import chains, tools
from tasks.calls import actions, schemas
from tests.conftest import AUTH
from tests.helpers import make_call, wait_status
from support.sse_client import Stream


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
    for method, path in taking:
        assert document["paths"][path][method]["callbacks"] == {"events": {"$ref": "#/components/callbacks/CallEvents"}}
    made = components["callbacks"]["CallEvents"]
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
        assert set(event) == set(described["properties"]), set(event) ^ set(described["properties"])
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
        assert set(data) == set(described["properties"]) - {"sent_at"}  # sent_at: callbacks only
