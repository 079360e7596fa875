"""Concurrent requests through the API: one winner, the rest told why, one row."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.api_fixtures import GUIDE_EMAIL, call_count, created_id
from tests.conftest import AUTH
from tests.helpers import row, wait_status

THREADS = 12


def _together(app, request):
    def one(_):
        with app.test_client() as own:
            answer = request(own)
            return answer.status_code, answer.get_json()
    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(one, range(THREADS)))


def test_concurrent_replays_make_one_row(client):
    body = {"session_id": "race", "function": "send_email", "parameters": GUIDE_EMAIL, "idempotency_key": "same"}
    answers = _together(client.application, lambda c: c.post("/voice-tools/pending", headers=AUTH, json=body))
    codes = sorted(code for code, _ in answers)
    assert codes == [200] * (THREADS - 1) + [201]
    assert len({answer["tool_call_id"] for _, answer in answers}) == 1
    assert call_count() == 1


def test_concurrent_confirms_start_the_chain_once(client, worker):
    tool_call_id = created_id(client)
    answers = _together(client.application, lambda c: c.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH))
    codes = sorted(code for code, _ in answers)
    assert codes == [202] + [409] * (THREADS - 1)
    assert all(answer["error"] == "invalid_status" for code, answer in answers if code == 409)
    stored = wait_status(tool_call_id, "PREPARED")
    assert [h["status"] for h in stored.status_history] == ["PENDING", "EXECUTING", "PREPARED"]
    assert row(tool_call_id).workflow_id == next(a["workflow_id"] for code, a in answers if code == 202)


def test_concurrent_executes_with_one_key_start_the_call_once_and_replay_the_rest(client, worker):
    """Every request but the one that started the call answers the replay (200, its
    record), never 409 invalid_status, even those that found the call still PENDING and confirmed too."""
    body = {"session_id": "race", "function": "send_email", "parameters": GUIDE_EMAIL, "idempotency_key": "ex-race"}
    answers = _together(client.application, lambda c: c.post("/voice-tools/execute", headers=AUTH, json=body))
    codes = sorted(code for code, _ in answers)
    assert codes == [200] * (THREADS - 1) + [202], answers
    assert len({answer["tool_call_id"] for _, answer in answers}) == 1
    assert call_count() == 1
    [started] = [answer for code, answer in answers if code == 202]
    replays = [answer for code, answer in answers if code == 200]
    assert all(answer["idempotency_key"] == "ex-race" and "status_history" in answer for answer in replays)
    stored = wait_status(started["tool_call_id"], "PREPARED")
    assert [h["status"] for h in stored.status_history] == ["PENDING", "EXECUTING", "PREPARED"]
    assert stored.workflow_id == started["workflow_id"]
