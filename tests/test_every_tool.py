"""Every tool of the registry, the same way: these tests grow by themselves with the tools.

Each tool declares realistic ``example`` parameters and the stated shape of its
result (``result_schema``). With the demo data loaded, each example is recorded,
run end to end by a real worker on the local backends (a checkpoint is proceeded
through), and must end COMPLETED with a result of its stated shape, a sentence to
say, and a callback per step in ``seq`` order.

Every rule is listed in docs/contributing.md ("What the tests hold a tool to"), and each failing
assertion names the rule it holds.
"""
from __future__ import annotations

import json

import pytest

from tasks import tools
from voice_tools_backends import load_demo
from tests.conftest import AUTH
from tests.helpers import deliveries, row
from tests.speech import markup_in, sentences

TOOLS = [tools.TOOLS[name] for name in tools.names()]
ids = [tool.name for tool in TOOLS]
# a spoken answer is at most two sentences, unless what the tool says needs more
LONGER_ANSWERS = {"knowledge_check": "it reads a question and its choices out, or which answers were wrong"}


def spoken_rules_broken(said: str | None, answer: bool = False, longer: bool = False) -> list[str]:
    """The rules a sentence a tool says breaks ([] when it keeps them all); ``answer``: the call's
    ``voice_response``, which is also a whole sentence; ``longer``: the tool may say more than two sentences."""
    said = said or ""
    broken = []
    if not said.strip():
        return ["it says something (not empty)"]
    if len(said) > 1000:
        broken.append(f"at most 1,000 characters (it has {len(said)})")
    if answer and not said[0].isupper():
        broken.append("it starts with a capital letter")
    if answer and said.rstrip()[-1] not in ".?!":
        broken.append("it ends with '.', '?' or '!'")
    broken += [f"plain speech to say aloud (it holds {what})" for what in markup_in(said)]
    if not longer and sentences(said) > 2:
        broken.append(f"at most two sentences (it has {sentences(said)}; a tool that needs more is named in "
                      "LONGER_ANSWERS with the reason)")
    return broken


@pytest.fixture
def demo_data():
    load_demo()


def test_the_registry_has_the_nine_tools():
    assert {"send_email", "schedule_meeting", "get_calendar_availability", "search_contacts", "create_task",
            "query_vector_db", "search_documentation", "get_training_progress", "knowledge_check"} <= set(tools.TOOLS)


def test_a_sentence_that_breaks_a_rule_is_told_which():
    """A contributor's first tool answering "Hello there" learns the rules it breaks, not just the sentence."""
    assert spoken_rules_broken("Hello there", answer=True) == ["it ends with '.', '?' or '!'"]
    assert spoken_rules_broken("see **docs.md**", answer=True) == [
        "it starts with a capital letter", "it ends with '.', '?' or '!'", "plain speech to say aloud (it holds Markdown "
        "emphasis)", "plain speech to say aloud (it holds a file name)"]
    assert spoken_rules_broken("One. Two. Three.") == ["at most two sentences (it has 3; a tool that needs more is "
                                                       "named in LONGER_ANSWERS with the reason)"]
    assert spoken_rules_broken("One. Two. Three.", longer=True) == spoken_rules_broken("Sent.", answer=True) == []
    assert spoken_rules_broken("") == ["it says something (not empty)"]


@pytest.mark.parametrize("tool", TOOLS, ids=ids)
def test_each_tool_declares_what_a_caller_and_an_operator_need(tool):
    assert tool.description, f"{tool.name}: a tool has a description"
    assert tool.action_level in ("read", "draft", "write"), f"{tool.name}: action_level is read, draft or write"
    assert tool.example, f"{tool.name}: declare example parameters"
    assert tool.result_schema is not None, f"{tool.name}: declare the result's shape (result_schema)"
    assert tool.schema().validate(dict(tool.example)) == {}, f"{tool.name}: its example is valid for its schema"
    assert [s.name for s in tool.steps][-1] == "COMPLETED", f"{tool.name}: the last step is named COMPLETED"
    assert tool.worker_group in tools.worker_groups() and tool.queue in tools.worker_groups()[tool.worker_group], \
        f"{tool.name}: its queue is its worker group's"
    effects = [s for s in tool.steps if s.side_effect]
    assert len(effects) <= 1, f"{tool.name}: at most one step has side_effect=True"
    if tool.action_level == "write":
        assert effects, f"{tool.name}: a write tool marks its point of no return (side_effect=True on one step)"
    parameters = tool.schema().load(dict(tool.example))
    for name, sentence in (("confirmation_message", tool.confirmation_message), ("start_message", tool.start_message),
                           ("modified_message", tool.modified_message), ("cancelled_response", tool.cancelled_response),
                           ("failure_response", tool.failure_response),
                           ("unconfirmed_response", tool.unconfirmed_response),
                           ("after_effect_failure_response", tool.after_effect_failure_response),
                           *((f"{step.name}'s message", step.message) for step in tool.steps if step.message)):
        said = tool.say(sentence, parameters, error="the service said no", tool=tool.spoken_name)
        broken = spoken_rules_broken(said)
        if "{" in said:  # str.format over the parameters: a placeholder left is a name the parameters lack
            broken.append("every placeholder is a parameter (no '{' left)")
        assert broken == [], f"{tool.name}'s {name} {said!r} breaks: {'; '.join(broken)}"


@pytest.mark.parametrize("tool", TOOLS, ids=ids)
def test_each_tool_runs_its_example_end_to_end(tool, client, worker, relay, demo_data):
    recorded = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_every", "function": tool.name, "parameters": dict(tool.example),
        "callback_url": relay.url})
    assert recorded.status_code == 201, f"{tool.name}: its example is recorded: {recorded.get_json()}"
    tool_call_id = recorded.get_json()["tool_call_id"]
    assert recorded.get_json()["message"] == tool.say(tool.confirmation_message, row(tool_call_id).parameters), \
        f"{tool.name}: pending answers its confirmation_message"

    answer = client.post(f"/voice-tools/confirm/{tool_call_id}?wait=30", headers=AUTH)
    assert answer.status_code == 200, f"{tool.name}: confirm?wait answers once it is done: {answer.get_json()}"
    body = answer.get_json()
    if any(step.checkpoint for step in tool.steps):
        assert body["status"] == "PREPARED", f"{tool.name}: a checkpoint step stops it PREPARED: {body}"
        checkpoint = relay.wait_for(tool_call_id, "checkpoint")
        assert checkpoint["requires_confirmation"] is True and checkpoint["preview"], \
            f"{tool.name}: a checkpoint step's preview says what will happen: {checkpoint}"
        answer = client.post(f"/voice-tools/resume/{tool_call_id}?wait=30", headers=AUTH, json={"action": "proceed"})
        assert answer.status_code == 200, f"{tool.name}: resume?wait answers once it is done: {answer.get_json()}"
        body = answer.get_json()
    assert body["status"] == "COMPLETED", f"{tool.name}: its example runs to COMPLETED on the demo data: {body}"

    stored = row(tool_call_id)
    assert stored.status == "COMPLETED" and stored.result == body["result"]
    assert tool.result_schema().validate(stored.result) == {}, \
        f"{tool.name}: its result has the shape of its result_schema: {stored.result}"
    voice = stored.voice_response
    broken = spoken_rules_broken(voice, answer=True, longer=tool.name in LONGER_ANSWERS)
    if voice and "{" in voice:
        broken.append("every placeholder is filled (no '{' left)")
    if voice and json.dumps(stored.result) in voice:
        broken.append("it says the result in words, not its JSON")
    assert broken == [], f"{tool.name}'s voice_response {voice!r} breaks: {'; '.join(broken)}"

    completed = relay.wait_for(tool_call_id, "completed")
    assert completed["voice_response"] == voice and completed["result"] == stored.result, \
        f"{tool.name}: the completed event carries the voice_response and the result"
    events = [d.event for d in deliveries(tool_call_id)]
    assert [d.seq for d in deliveries(tool_call_id)] == list(range(1, len(events) + 1)), \
        f"{tool.name}: its callbacks are numbered 1, 2, ... in order: {events}"
    assert events[-1] == "completed" and events.count("completed") == 1, \
        f"{tool.name}: one completed event, the last: {events}"
    # one progress event per step before the last, the checkpoint's being its own event
    assert len(events) == len(tool.steps), f"{tool.name}: one callback per step: {events}"


@pytest.mark.parametrize("tool", TOOLS, ids=ids)
def test_each_tool_names_its_bad_parameter_and_changes_nothing(tool, client):
    from tests.api_fixtures import snapshot

    before = snapshot()
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_every", "function": tool.name, "parameters": {**tool.example, "no_such_field": 1}})
    assert answer.status_code == 422, f"{tool.name}: an unknown parameter is refused (422): {answer.get_json()}"
    assert "no_such_field" in answer.get_json()["details"]["fields"]["parameters"], \
        f"{tool.name}: the refusal names the unknown parameter"
    required = [name for name, field in tool.schema().fields.items() if field.required]
    if required:
        missing = {k: v for k, v in tool.example.items() if k != required[0]}
        answer = client.post("/voice-tools/pending", headers=AUTH, json={
            "session_id": "sess_every", "function": tool.name, "parameters": missing})
        assert answer.status_code == 422, f"{tool.name}: a missing required parameter is refused (422)"
        assert required[0] in answer.get_json()["details"]["fields"]["parameters"], \
            f"{tool.name}: the refusal names the missing parameter"
    assert snapshot() == before, f"{tool.name}: a refused call records nothing"
