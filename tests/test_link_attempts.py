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


def test_a_reason_never_holds_what_the_tool_said_of_its_parameters():
    """A tool's or a backend's own error is a sentence for the person, made of the call's parameters and the
    data they found: its reason is its class alone. Another library's keeps its first line (a database
    error's DETAIL, with the row's values, is on the next)."""
    from tasks.tools import PermanentError, TransientError
    from voice_tools_backends import Refused, Unavailable

    for error in (PermanentError("you already have Secret-769f015f then"), TransientError("Secret-1 is busy"),
                  Refused("Google Tasks refused it (Secret-2)"), Unavailable("Gmail rate limit: Secret-3")):
        assert link_attempts.reason_of(error) == type(error).__name__, error
    said = link_attempts.reason_of(ValueError('duplicate key value violates unique constraint "uq"\n'
                                              'DETAIL:  Key (title)=(Secret-4) already exists.'))
    assert said == 'ValueError: duplicate key value violates unique constraint "uq"'
