"""Acting on many calls at once from the console, chosen by the list's filters: the count first, then
the action on exactly those, confirmed by that count, with each call's result."""
from __future__ import annotations

import pytest

from tests.api_fixtures import GUIDE_EMAIL
from tests.conftest import API_TOKEN, AUTH

OPS = {"Authorization": "Bearer ops-token"}
BOB = {"Authorization": "Bearer bob-token"}


@pytest.fixture(autouse=True)
def tokens(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN},bob:bob-token,ops:ops-token:admin")


def record(client, session_id: str, headers=AUTH) -> str:
    answer = client.post("/voice-tools/pending", headers=headers, json={
        "session_id": session_id, "function": "send_email", "parameters": dict(GUIDE_EMAIL)})
    assert answer.status_code == 201
    return answer.get_json()["tool_call_id"]


def test_a_bulk_cancel_counts_first_then_cancels_exactly_those_each_with_its_result(client):
    ours = [record(client, "sess_bulk") for _ in range(3)]
    ended = ours[0]
    assert client.delete(f"/voice-tools/cancel/{ended}", headers=AUTH).status_code == 200
    record(client, "sess_bulk_other")
    chosen = client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk"}, headers=OPS).get_json()
    assert chosen == {"count": 2, "tool_call_ids": ours[:0:-1], "more": False}  # the open ones, newest first
    stale = client.post("/console/api/bulk/cancel", headers=OPS,
                        json={"filters": {"session_id": "sess_bulk"}, "expected": 3, "reason": "Duplicates"})
    assert stale.status_code == 409 and stale.get_json()["error"] == "changed"  # confirmed for another count
    done = client.post("/console/api/bulk/cancel", headers=OPS,
                       json={"filters": {"session_id": "sess_bulk"}, "expected": 2, "reason": "Duplicates"})
    assert done.status_code == 200, done.get_json()
    results = done.get_json()["results"]
    assert [(r["tool_call_id"], r["ok"], r["status"]) for r in results] == [(i, True, "CANCELLED") for i in ours[:0:-1]]
    for tool_call_id in ours[1:]:
        last = client.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH).get_json()["status_history"][-1]
        assert (last["reason"], last["by"], last["via"]) == ("Duplicates", "ops", "console")
    assert client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk"},
                      headers=OPS).get_json()["count"] == 0
    # fenced: bob chooses among his own calls only
    assert client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk_other"},
                      headers=BOB).get_json()["count"] == 0
    assert client.get("/console/api/bulk/forget", headers=OPS).status_code == 404


def test_a_bulk_redeliver_takes_the_calls_with_a_failed_delivery(client):
    from models import db
    from sqlalchemy import text

    failed_one, fine = record(client, "sess_bulk_r"), record(client, "sess_bulk_r")
    for tool_call_id in (failed_one, fine):
        assert client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH).status_code == 200
    with db.session() as s:  # the cancelled event of one given up, with a URL to send it to
        s.execute(text("UPDATE callback_deliveries SET state = 'failed', url = 'http://127.0.0.1:9/hook', "
                       "attempts = 8 WHERE tool_call_id = :i"), {"i": failed_one})
    chosen = client.get("/console/api/bulk/redeliver", query_string={"session_id": "sess_bulk_r"}, headers=OPS)
    assert chosen.get_json() == {"count": 1, "tool_call_ids": [failed_one], "more": False}
    done = client.post("/console/api/bulk/redeliver", headers=OPS,
                       json={"filters": {"session_id": "sess_bulk_r"}, "expected": 1}).get_json()
    assert [(r["tool_call_id"], r["ok"], r["queued"]) for r in done["results"]] == [(failed_one, True, 1)]
