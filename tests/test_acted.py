"""Who acted, and through which face: every action on a call (REST, MCP, the console, the CLI, beat)
leaves its token's name (``by``) and its face (``via``) on the entry it adds to the call's
``status_history``, read back in the REST record, the console's call and ``calls show``."""
from __future__ import annotations

import json
import pytest

from tests.api_fixtures import GUIDE_EMAIL
from tests.conftest import API_TOKEN, AUTH

OPS = {"Authorization": "Bearer ops-token"}


@pytest.fixture(autouse=True)
def two_tokens(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN},ops:ops-token:admin")


def record(client, headers=AUTH, **parameters) -> str:
    answer = client.post("/voice-tools/pending", headers=headers, json={
        "session_id": "sess_acted", "function": "send_email", "parameters": {**GUIDE_EMAIL, **parameters}})
    assert answer.status_code == 201, answer.get_json()
    return answer.get_json()["tool_call_id"]


def history(client, tool_call_id: str) -> list[dict]:
    answer = client.get(f"/voice-tools/status/{tool_call_id}", headers=OPS)
    assert answer.status_code == 200
    return answer.get_json()["status_history"]


def test_rest_records_the_token_and_the_face_of_each_action(client):
    tool_call_id = record(client)
    assert client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                        json={"parameters": {"subject": "Other"}}).status_code == 200
    assert client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=OPS,
                         json={"reason": "Wrong person"}).status_code == 200
    entries = history(client, tool_call_id)
    assert [(e["status"], e.get("by"), e.get("via")) for e in entries] == [
        ("PENDING", "tests", "REST"), ("MODIFIED", "tests", "REST"), ("PENDING", "tests", "REST"),
        ("CANCELLED", "ops", "REST")]
    assert entries[-1]["reason"] == "Wrong person"


def test_the_console_cancels_with_a_reason_bounded_as_every_string_and_records_its_face(client):
    tool_call_id = record(client)
    too_long = client.post(f"/console/api/calls/{tool_call_id}/cancel", headers=OPS, json={"reason": "x" * 501})
    assert too_long.status_code == 422
    control = client.post(f"/console/api/calls/{tool_call_id}/cancel", headers=OPS, json={"reason": "a\x07b"})
    assert control.status_code == 422  # the same rules as every string: no control character
    done = client.post(f"/console/api/calls/{tool_call_id}/cancel", headers=OPS, json={"reason": "Duplicate"})
    assert done.status_code == 200, done.get_json()
    last = history(client, tool_call_id)[-1]
    assert (last["status"], last["reason"], last["by"], last["via"]) == ("CANCELLED", "Duplicate", "ops", "console")

    other = record(client)  # no reason given: the console's own sentence
    assert client.post(f"/console/api/calls/{other}/cancel", headers=OPS, json={}).status_code == 200
    last = history(client, other)[-1]
    assert (last["reason"], last["by"], last["via"]) == ("Cancelled from the console", "ops", "console")

    # the console's call shows the same history
    shown = client.get(f"/console/api/calls/{other}", headers=OPS).get_json()
    assert shown["record"]["status_history"][-1]["via"] == "console"


def test_the_console_fences_its_actions_as_rest_does(client):
    theirs = record(client, headers=OPS)
    assert client.post(f"/console/api/calls/{theirs}/cancel", headers=AUTH, json={}).status_code == 404
    assert client.post(f"/console/api/calls/{theirs}/proceed", headers=AUTH, json={}).status_code == 404
    assert client.post(f"/console/api/calls/{theirs}/proceed", headers=OPS, json={}).status_code == 409  # PENDING


def test_the_openapi_schema_describes_who_acted(client):
    spec = client.get("/openapi.json", headers=AUTH).get_json()
    entry = spec["components"]["schemas"]["StatusEntry"]["properties"]
    assert {"by", "via"} <= set(entry)
    assert set(entry["via"]["enum"]) >= {"REST", "MCP", "console", "CLI", "beat"}


def test_the_cli_records_its_face_and_the_operator_and_calls_show_prints_them(client):
    from tests.test_cli import cli

    tool_call_id = record(client)
    cli("calls", "cancel", tool_call_id, "--reason", "From the shell", "--json")
    last = history(client, tool_call_id)[-1]
    assert (last["status"], last["reason"], last["via"]) == ("CANCELLED", "From the shell", "CLI")
    assert last["by"]  # the operator's user name on the machine that ran it
    shown = cli("calls", "show", tool_call_id).output
    history_lines = shown.split("Status history", 1)[1].split("Parameter changes", 1)[0]
    assert "BY" in history_lines and "VIA" in history_lines
    assert "tests" in history_lines and "REST" in history_lines and "CLI" in history_lines
    as_json = json.loads(cli("calls", "show", tool_call_id, "--json").output)
    assert as_json["status_history"][0]["by"] == "tests"


def test_an_expiry_by_beat_names_its_sweep(client):
    from tasks.calls import actions

    tool_call_id = record(client)
    assert actions.expire(tool_call_id, pending_ttl_s=0, prepared_ttl_s=0) is not None
    last = history(client, tool_call_id)[-1]
    assert (last["status"], last["by"], last["via"]) == ("EXPIRED", "expiry sweep", "beat")
