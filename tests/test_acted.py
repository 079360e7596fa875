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


def at_checkpoint(client, headers=AUTH) -> str:
    """A call at its checkpoint (READY_TO_SEND), put there by the state machine as its chain would."""
    from models import db, lifecycle

    tool_call_id = record(client, headers)
    with db.session() as s:
        lifecycle.confirm(s, tool_call_id)
        lifecycle.checkpoint(s, tool_call_id, "READY_TO_SEND", 0.5, output={"to": GUIDE_EMAIL["to"]})
    return tool_call_id


def after(entries: list[dict], status: str) -> dict:
    """The entry that follows the first of ``status``: the action taken there."""
    return entries[[e["status"] for e in entries].index(status) + 1]


RELAY_WORDS = ("caller", "user", "relay")  # words that name who acted, true only of the relay's own token


def test_each_entry_says_what_was_done_and_names_no_one_but_who_did_it(client, celery_app_instance):
    from tests.conftest import purge_queues
    from tests.test_cli import cli

    try:
        # the relay's own cancel speaks for its user, as promised to relays; an operator's says so
        relays = record(client)
        assert client.delete(f"/voice-tools/cancel/{relays}", headers=AUTH).status_code == 200
        assert history(client, relays)[-1]["reason"] == "Cancelled by user"
        operators = record(client)
        assert client.delete(f"/voice-tools/cancel/{operators}", headers=OPS).status_code == 200
        assert history(client, operators)[-1]["reason"] == "Cancelled by an operator"
        shell = record(client)
        cli("calls", "cancel", shell, "--json")
        assert history(client, shell)[-1]["reason"] == "Cancelled by an operator"
        # Proceed from the console by an operator, from REST by the relay: the same words, each its own by/via
        console = at_checkpoint(client)
        assert client.post(f"/console/api/calls/{console}/proceed", headers=OPS, json={}).status_code == 202
        rest = at_checkpoint(client)
        assert client.post(f"/voice-tools/resume/{rest}", headers=AUTH, json={"action": "proceed"}).status_code == 202
        for tool_call_id, who in ((console, ("ops", "console")), (rest, ("tests", "REST"))):
            proceeded = after(history(client, tool_call_id), "PREPARED")  # (a worker may run the rest meanwhile)
            assert (proceeded["status"], proceeded["reason"], proceeded["by"], proceeded["via"]) == (
                "EXECUTING", "Proceeded from its checkpoint", *who)
        # at the checkpoint, an operator's cancel through REST's resume
        stopped = at_checkpoint(client)
        assert client.post(f"/voice-tools/resume/{stopped}", headers=OPS, json={"action": "cancel"}).status_code == 200
        assert history(client, stopped)[-1]["reason"] == "Cancelled by an operator"
        # a confirm, and an operator's execute
        confirmed = record(client, headers=OPS)
        assert client.post(f"/voice-tools/confirm/{confirmed}", headers=OPS, json={}).status_code == 202
        assert after(history(client, confirmed), "PENDING")["reason"] == "Confirmed"
        executed = client.post("/voice-tools/execute", headers=OPS, json={
            "session_id": "sess_acted", "function": "send_email", "parameters": dict(GUIDE_EMAIL)}).get_json()
        # every entry of every call: none names the caller, a user or the relay but the relay's own
        for tool_call_id in (relays, operators, shell, console, rest, stopped, confirmed, executed["tool_call_id"]):
            for entry in history(client, tool_call_id):
                if entry.get("by") != "tests":
                    assert not any(word in (entry["reason"] or "").lower() for word in RELAY_WORDS), entry
    finally:
        purge_queues(celery_app_instance)  # the chains started here are run by no worker


def failed_delivery(client, session_id: str = "sess_acted") -> tuple[str, str]:
    """A cancelled call whose ``cancelled`` event was given up, with a URL to send it to."""
    from sqlalchemy import text

    from models import db

    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": session_id, "function": "send_email", "parameters": dict(GUIDE_EMAIL)})
    tool_call_id = answer.get_json()["tool_call_id"]
    assert client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH).status_code == 200
    with db.session() as s:
        event_id = s.execute(text("UPDATE callback_deliveries SET state = 'failed', url = 'http://127.0.0.1:9/hook', "
                                  "attempts = 8 WHERE tool_call_id = :i RETURNING event_id"),
                             {"i": tool_call_id}).scalar_one()
    return tool_call_id, event_id


def test_a_redelivery_records_who_asked_and_through_which_face_from_the_console_the_cli_and_in_bulk(
        client, celery_app_instance):
    from tests.conftest import purge_queues
    from tests.test_cli import cli

    try:
        one, event = failed_delivery(client)
        assert client.post(f"/console/api/calls/{one}/events/{event}/redeliver", headers=OPS).status_code == 202
        last = history(client, one)[-1]
        assert last == {**last, "status": "CANCELLED", "reason": "Callback redelivered: event 1 (cancelled)",
                        "by": "ops", "via": "console", "redelivered": [event]}
        shown = client.get(f"/console/api/calls/{one}", headers=OPS).get_json()  # the console's timeline reads it
        assert shown["record"]["status_history"][-1]["redelivered"] == [event]

        two, event = failed_delivery(client)
        assert cli("callbacks", "redeliver", "--failed", "--call", two).exit_code == 0
        last = history(client, two)[-1]
        assert (last["status"], last["via"], last["redelivered"]) == ("CANCELLED", "CLI", [event]) and last["by"]
        printed = cli("calls", "show", two).output.split("Status history", 1)[1].split("Parameter changes", 1)[0]
        assert "Callback redelivered: event 1 (cancelled)" in printed and "CLI" in printed

        three, event = failed_delivery(client, "sess_acted_bulk")
        chosen = client.get("/console/api/bulk/redeliver", query_string={"session_id": "sess_acted_bulk"},
                            headers=OPS).get_json()
        done = client.post("/console/api/bulk/redeliver", headers=OPS, json={
            "filters": {"session_id": "sess_acted_bulk"}, "expected": chosen["count"], "until": chosen["until"]})
        assert done.status_code == 200, done.get_json()
        last = history(client, three)[-1]
        assert (last["by"], last["via"], last["redelivered"]) == ("ops", "console", [event])
    finally:
        purge_queues(celery_app_instance)  # the deliveries queued here go to no relay
