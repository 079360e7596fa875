"""Every tool of the registry, the same way: these tests grow by themselves with the tools.

Each tool declares realistic ``example`` parameters and the stated shape of its
result (``result_schema``). With the demo data loaded, each example is recorded,
run end to end by a real worker on the local backends (a checkpoint is proceeded
through), and must end COMPLETED with a result of its stated shape, a sentence to
say, and a callback per step in ``seq`` order.
"""
from __future__ import annotations

import json

import pytest

from tasks import tools
from voice_tools.backends import load_demo
from tests.conftest import AUTH
from tests.helpers import deliveries, row
from tests.speech import markup_in, sentences

TOOLS = [tools.TOOLS[name] for name in tools.names()]
ids = [tool.name for tool in TOOLS]
# a spoken answer is at most two sentences, unless what the tool says needs more
LONGER_ANSWERS = {"knowledge_check": "it reads a question and its choices out, or which answers were wrong"}


@pytest.fixture
def demo_data():
    load_demo()


def test_the_registry_has_the_nine_tools():
    assert {"send_email", "schedule_meeting", "get_calendar_availability", "search_contacts", "create_task",
            "query_vector_db", "search_documentation", "get_training_progress", "knowledge_check"} <= set(tools.TOOLS)


@pytest.mark.parametrize("tool", TOOLS, ids=ids)
def test_each_tool_declares_what_a_caller_and_an_operator_need(tool):
    assert tool.description and tool.action_level in ("read", "draft", "write")
    assert tool.example, f"{tool.name}: declare example parameters"
    assert tool.result_schema is not None, f"{tool.name}: declare the result's shape"
    assert tool.schema().validate(dict(tool.example)) == {}
    assert [s.name for s in tool.steps][-1] == "COMPLETED"
    assert tool.worker_group in tools.worker_groups() and tool.queue in tools.worker_groups()[tool.worker_group]
    effects = [s for s in tool.steps if s.side_effect]
    assert len(effects) <= 1
    if tool.action_level == "write":
        assert effects, f"{tool.name}: a write tool marks its point of no return"
    parameters = tool.schema().load(dict(tool.example))
    for sentence in (tool.confirmation_message, tool.start_message, tool.modified_message, tool.cancelled_response,
                     tool.failure_response, tool.unconfirmed_response, tool.after_effect_failure_response,
                     *(step.message for step in tool.steps if step.message)):
        said = tool.say(sentence, parameters, error="the service said no", tool=tool.spoken_name)
        assert said.strip() and "{" not in said and len(said) <= 1000, (tool.name, said)
        assert markup_in(said) == [], (tool.name, said)  # said aloud: plain speech
        assert sentences(said) <= 2, (tool.name, said)


@pytest.mark.parametrize("tool", TOOLS, ids=ids)
def test_each_tool_runs_its_example_end_to_end(tool, client, worker, relay, demo_data):
    recorded = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_every", "function": tool.name, "parameters": dict(tool.example),
        "callback_url": relay.url})
    assert recorded.status_code == 201, recorded.get_json()
    tool_call_id = recorded.get_json()["tool_call_id"]
    assert recorded.get_json()["message"] == tool.say(tool.confirmation_message, row(tool_call_id).parameters)

    answer = client.post(f"/voice-tools/confirm/{tool_call_id}?wait=30", headers=AUTH)
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    if any(step.checkpoint for step in tool.steps):
        assert body["status"] == "PREPARED", body
        checkpoint = relay.wait_for(tool_call_id, "checkpoint")
        assert checkpoint["requires_confirmation"] is True and checkpoint["preview"], checkpoint
        answer = client.post(f"/voice-tools/resume/{tool_call_id}?wait=30", headers=AUTH, json={"action": "proceed"})
        assert answer.status_code == 200, answer.get_json()
        body = answer.get_json()
    assert body["status"] == "COMPLETED", body

    stored = row(tool_call_id)
    assert stored.status == "COMPLETED" and stored.result == body["result"]
    assert tool.result_schema().validate(stored.result) == {}, stored.result
    voice = stored.voice_response
    assert voice and len(voice) <= 1000 and voice[0].isupper() and voice.rstrip()[-1] in ".?!", voice
    assert "{" not in voice and json.dumps(stored.result) not in voice, voice
    assert markup_in(voice) == [], voice
    assert tool.name in LONGER_ANSWERS or sentences(voice) <= 2, voice

    completed = relay.wait_for(tool_call_id, "completed")
    assert completed["voice_response"] == voice and completed["result"] == stored.result
    events = [d.event for d in deliveries(tool_call_id)]
    assert [d.seq for d in deliveries(tool_call_id)] == list(range(1, len(events) + 1))
    assert events[-1] == "completed" and events.count("completed") == 1
    # one progress event per step before the last, the checkpoint's being its own event
    assert len(events) == len(tool.steps), events


@pytest.mark.parametrize("tool", TOOLS, ids=ids)
def test_each_tool_names_its_bad_parameter_and_changes_nothing(tool, client):
    from tests.api_fixtures import snapshot

    before = snapshot()
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_every", "function": tool.name, "parameters": {**tool.example, "no_such_field": 1}})
    assert answer.status_code == 422, answer.get_json()
    assert "no_such_field" in answer.get_json()["details"]["fields"]["parameters"]
    required = [name for name, field in tool.schema().fields.items() if field.required]
    if required:
        missing = {k: v for k, v in tool.example.items() if k != required[0]}
        answer = client.post("/voice-tools/pending", headers=AUTH, json={
            "session_id": "sess_every", "function": tool.name, "parameters": missing})
        assert answer.status_code == 422
        assert required[0] in answer.get_json()["details"]["fields"]["parameters"]
    assert snapshot() == before
