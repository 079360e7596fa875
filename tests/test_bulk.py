"""Acting on many calls at once from the console, chosen by the list's filters: the count first (as of the
newest call matching then), then the action on exactly those once that count is confirmed, a keyset batch
a request, each call's result and their counts by outcome; a bound the operator is told of."""
from __future__ import annotations

import pytest
from sqlalchemy import text

from models import db, lifecycle
from tasks.calls import bulk
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


def many(count: int, session_id: str) -> list[str]:
    """``count`` PENDING calls of the relay's caller, recorded by the state machine in one transaction."""
    with db.session() as s:
        return [lifecycle.create(s, session_id=session_id, function_name="send_email", action_level="write",
                                 parameters=dict(GUIDE_EMAIL), caller="tests")[0].tool_call_id
                for _ in range(count)]


def run(client, action: str, filters: dict, chosen: dict, **extra) -> tuple[list[dict], dict, int]:
    """Every batch of ``action`` until the last: each call's result, the counts by outcome, the requests."""
    results, counts, requests, after = [], {}, 0, None
    while True:
        answer = client.post(f"/console/api/bulk/{action}", headers=OPS, json={
            "filters": filters, "expected": chosen["count"], "until": chosen["until"], **extra,
            **({"after": after} if after else {})})
        assert answer.status_code == 200, answer.get_json()
        body, requests = answer.get_json(), requests + 1
        assert len(body["results"]) <= bulk.BATCH
        results += body["results"]
        for outcome, n in body["counts"].items():
            counts[outcome] = counts.get(outcome, 0) + n
        after = body["next"]
        if after is None:
            return results, counts, requests


def test_a_bulk_cancel_counts_first_then_cancels_exactly_those_each_with_its_result(client):
    ours = [record(client, "sess_bulk") for _ in range(3)]
    ended = ours[0]
    assert client.delete(f"/voice-tools/cancel/{ended}", headers=AUTH).status_code == 200
    record(client, "sess_bulk_other")
    chosen = client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk"}, headers=OPS).get_json()
    assert {k: chosen[k] for k in ("count", "over", "bound")} == {"count": 2, "over": False, "bound": bulk.MAX_CALLS}
    assert chosen["until"]["id"] == ours[-1]  # the newest of the open ones
    stale = client.post("/console/api/bulk/cancel", headers=OPS, json={
        "filters": {"session_id": "sess_bulk"}, "expected": 3, "until": chosen["until"], "reason": "Duplicates"})
    assert stale.status_code == 409 and stale.get_json()["error"] == "changed"  # confirmed for another count
    results, counts, _ = run(client, "cancel", {"session_id": "sess_bulk"}, chosen, reason="Duplicates")
    assert [(r["tool_call_id"], r["ok"], r["status"]) for r in results] == [(i, True, "CANCELLED") for i in ours[:0:-1]]
    assert counts == {"cancelled": 2}
    for tool_call_id in ours[1:]:
        last = client.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH).get_json()["status_history"][-1]
        assert (last["reason"], last["by"], last["via"]) == ("Duplicates", "ops", "console")
    assert client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk"},
                      headers=OPS).get_json()["count"] == 0
    # fenced: bob chooses among his own calls only
    assert client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk_other"},
                      headers=BOB).get_json()["count"] == 0
    assert client.get("/console/api/bulk/forget", headers=OPS).status_code == 404


def test_a_bulk_cancel_takes_every_matching_call_in_batches_and_none_recorded_after_the_count(client):
    matched = many(2 * bulk.BATCH + 7, "sess_bulk_many")
    chosen = client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk_many"},
                        headers=OPS).get_json()
    assert chosen["count"] == len(matched) and not chosen["over"]
    later = record(client, "sess_bulk_many")  # recorded after the count: not among those confirmed
    results, counts, requests = run(client, "cancel", {"session_id": "sess_bulk_many"}, chosen)
    assert requests == 3 and counts == {"cancelled": len(matched)}
    assert sorted(r["tool_call_id"] for r in results) == sorted(matched)  # every one, once
    with db.session() as s:
        statuses = dict(s.execute(text("SELECT status, count(*) FROM tool_calls WHERE session_id = 'sess_bulk_many' "
                                       "GROUP BY status")).all())
    assert statuses == {"CANCELLED": len(matched), "PENDING": 1}
    assert client.get(f"/voice-tools/status/{later}", headers=AUTH).get_json()["status"] == "PENDING"


def test_a_call_that_ended_meanwhile_is_left_and_a_refused_one_reported_as_rest_would(client):
    calls = many(3, "sess_bulk_meanwhile")
    chosen = client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk_meanwhile"},
                        headers=OPS).get_json()
    with db.session() as s:  # one passed its point of no return after the count
        lifecycle.confirm(s, calls[1])
        lifecycle.begin_step(s, calls[1], "SENDING", 0.5, commit=True)
    results, counts, _ = run(client, "cancel", {"session_id": "sess_bulk_meanwhile"}, chosen)
    assert counts == {"cancelled": 2, "too_late": 1}
    refused = next(r for r in results if not r["ok"])
    assert refused["tool_call_id"] == calls[1] and refused["message"]


def test_more_calls_than_the_bound_are_said_and_none_is_taken(client, monkeypatch):
    monkeypatch.setattr(bulk, "MAX_CALLS", 4)
    many(5, "sess_bulk_bound")
    chosen = client.get("/console/api/bulk/cancel", query_string={"session_id": "sess_bulk_bound"},
                        headers=OPS).get_json()
    assert (chosen["count"], chosen["over"], chosen["bound"]) == (4, True, 4)
    refused = client.post("/console/api/bulk/cancel", headers=OPS, json={
        "filters": {"session_id": "sess_bulk_bound"}, "expected": 4, "until": chosen["until"]})
    assert refused.status_code == 409 and refused.get_json()["error"] == "too_many"
    with db.session() as s:
        assert s.scalar(text("SELECT count(*) FROM tool_calls WHERE session_id = 'sess_bulk_bound' "
                             "AND status = 'PENDING'")) == 5


def test_a_bulk_redeliver_takes_the_calls_with_a_failed_delivery(client, celery_app_instance):
    from tests.conftest import purge_queues

    failed_one, fine = record(client, "sess_bulk_r"), record(client, "sess_bulk_r")
    for tool_call_id in (failed_one, fine):
        assert client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=AUTH).status_code == 200
    with db.session() as s:  # the cancelled event of one given up, with a URL to send it to
        s.execute(text("UPDATE callback_deliveries SET state = 'failed', url = 'http://127.0.0.1:9/hook', "
                       "attempts = 8 WHERE tool_call_id = :i"), {"i": failed_one})
    chosen = client.get("/console/api/bulk/redeliver", query_string={"session_id": "sess_bulk_r"}, headers=OPS)
    assert (chosen.get_json()["count"], chosen.get_json()["until"]["id"]) == (1, failed_one)
    try:
        results, counts, _ = run(client, "redeliver", {"session_id": "sess_bulk_r"}, chosen.get_json())
    finally:
        purge_queues(celery_app_instance)  # the delivery queued here goes to no relay
    assert [(r["tool_call_id"], r["ok"], r["queued"]) for r in results] == [(failed_one, True, 1)]
    assert counts == {"queued": 1}


def test_each_batch_and_the_count_are_bounded_reads_of_one_index_range():
    """Held without ten million rows, as the list's pages are (``test_console_api``): with sequential scans
    and sorts priced out, a batch after a cursor and the bounded count stay index scans with no sort of
    the whole selection, for a cancel and for a redelivery (its failed delivery an index probe)."""
    from datetime import datetime, timezone

    from sqlalchemy.dialects import postgresql

    from models import browse
    from tests.test_console_api import PLANS, _nodes

    now = datetime.now(timezone.utc)
    for given in PLANS.values():
        selection = {"scope": given.get("scope"), "statuses": given.get("statuses", ()),
                     "filters": {k: v for k, v in given.items() if k not in ("scope", "statuses")}}
        for failed_delivery in (False, True):
            for stmt in (browse.chosen_batch(**selection, until=(now, "tc_zzzz"), after=(now, "tc_yyyy"),
                                             failed_delivery=failed_delivery, limit=bulk.BATCH),
                         browse.chosen_count(**selection, until=(now, "tc_zzzz"), failed_delivery=failed_delivery,
                                             at_most=bulk.MAX_CALLS)):
                sql = str(stmt.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
                assert "LIMIT" in sql.upper() and "OFFSET" not in sql.upper()
                with db.engine().connect() as conn:
                    conn.execute(text("SET LOCAL enable_seqscan = off"))
                    conn.execute(text("SET LOCAL enable_sort = off"))
                    plan = conn.execute(text(f"EXPLAIN (FORMAT JSON) {sql}")).scalar_one()[0]["Plan"]
                nodes = _nodes(plan)
                assert "Seq Scan" not in nodes and "Sort" not in nodes, (given, failed_delivery, nodes)
