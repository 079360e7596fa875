"""The runs of a call's links as the call keeps them (``models/link_attempts.py``): the latest
``KEPT`` in order, each reason short and without what a URL carries."""
from __future__ import annotations

from models import db, link_attempts, lifecycle, queries
from tests.helpers import make_call


def test_only_the_latest_runs_are_kept_oldest_dropped_first():
    call = make_call()
    for n in range(link_attempts.KEPT + 5):
        with db.session() as s:
            lifecycle.add_attempt(s, call.tool_call_id, link_attempts.entry(
                "FETCH", 1_700_000_000 + n, 0.001 * n, link_attempts.RETRIED, TimeoutError(f"try {n}")))
    with db.session() as s:
        kept = queries.get(s, call.tool_call_id).link_attempts
    assert [run["reason"] for run in kept] == [f"TimeoutError: try {n}" for n in range(5, link_attempts.KEPT + 5)]
    assert kept[0]["started_at"] == "2023-11-14T22:13:25+00:00" and kept[0]["took_ms"] == 5.0


def test_a_reason_is_short_and_carries_no_credentials_or_query():
    said = link_attempts.reason_of(ConnectionError("POST https://user:s3cret@api.example/v1/send?key=abc failed"))
    assert said == "ConnectionError: POST https://api.example/v1/send?… failed"
    assert len(link_attempts.reason_of(ValueError("x" * 500))) == link_attempts.REASON_CHARS
    assert link_attempts.reason_of(KeyError()) == "KeyError"
