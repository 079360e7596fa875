"""A FAILED call whose effect was not done, run again from the console: a new call linked to the old
one both ways in their histories, started at once (a real worker runs it: no chain is left in a
queue); never a call whose effect was done, and an ``unconfirmed`` one only with an explicit
acknowledgment that its first run may have acted."""
from __future__ import annotations

import pytest

from models import db, lifecycle
from models.calls import DONE, NOT_DONE, PENDING, UNCONFIRMED
from tests.conftest import API_TOKEN, AUTH
from tests.helpers import make_call, row

OPS = {"Authorization": "Bearer ops-token"}
BOB = {"Authorization": "Bearer bob-token"}


@pytest.fixture(autouse=True)
def tokens(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN},bob:bob-token,ops:ops-token:admin")


def failed(outcome: str, **kw) -> str:
    call = make_call(callback_url=None, **kw)
    with db.session() as s:
        assert lifecycle.fail(s, call.tool_call_id, "The mail server refused it.", "It failed.",
                              from_statuses=(PENDING,), outcome=outcome) is not None
    return call.tool_call_id


def again(client, tool_call_id: str, headers=OPS, **body):
    return client.post(f"/console/api/calls/{tool_call_id}/run-again", headers=headers, json=body)


def test_a_failed_call_not_done_runs_again_as_a_new_call_linked_both_ways(client, worker):
    old = failed(NOT_DONE)
    answer = again(client, old)
    assert answer.status_code == 202, answer.get_json()
    new = answer.get_json()["tool_call_id"]
    assert new != old
    made, before = row(new), row(old)
    assert (made.function_name, made.parameters, made.session_id, made.caller) == (
        before.function_name, before.parameters, before.session_id, before.caller)  # the same call, the caller's own
    assert made.status in ("EXECUTING", "PREPARED", "COMPLETED")  # started at once
    first = made.status_history[0]
    assert (first["status"], first["again_of"], first["by"], first["via"]) == ("PENDING", old, "ops", "console")
    last = before.status_history[-1]
    assert (last["status"], last["run_again_as"], last["by"], last["via"]) == ("FAILED", new, "ops", "console")
    assert before.status == "FAILED"
    shown = client.get(f"/console/api/calls/{old}", headers=OPS).get_json()
    assert shown["record"]["status_history"][-1]["run_again_as"] == new  # in the REST record too
    assert shown["console_actions"] == []  # run again once only
    refused = again(client, old)
    assert refused.status_code == 409 and refused.get_json()["error"] == "invalid_status"


def test_an_unconfirmed_call_runs_again_only_with_the_acknowledgment(client, worker):
    old = failed(UNCONFIRMED)
    assert client.get(f"/console/api/calls/{old}", headers=OPS).get_json()["console_actions"] == ["run_again"]
    refused = again(client, old)
    assert refused.status_code == 409 and refused.get_json()["error"] == "may_have_acted"
    assert "run_again_as" not in row(old).status_history[-1]  # nothing done
    assert again(client, old, acknowledge_may_have_acted=False).status_code == 409
    answer = again(client, old, acknowledge_may_have_acted=True)
    assert answer.status_code == 202, answer.get_json()
    assert row(answer.get_json()["tool_call_id"]).status_history[0]["again_of"] == old


def test_a_call_whose_effect_was_done_or_that_did_not_fail_is_never_run_again(client, worker):
    done = failed(DONE)
    assert client.get(f"/console/api/calls/{done}", headers=OPS).get_json()["console_actions"] == []
    assert again(client, done).status_code == 409
    pending = make_call().tool_call_id
    assert again(client, pending).status_code == 409
    assert again(client, failed(NOT_DONE), headers=BOB).status_code == 404  # fenced: another caller's
    assert again(client, failed(NOT_DONE), headers=AUTH).status_code == 202  # its own caller may
