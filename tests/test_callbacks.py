"""Callbacks to the relay (docs/relay-guide.md, Callbacks): signing, ordering, retries recorded
on the row, the relay's answers, slow relays, allowed hosts, no redirects."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from standardwebhooks import Webhook, WebhookVerificationError

from models import db, events, lifecycle, queries
from models.email import EmailOutbox
from tasks.calls import actions
from tasks.delivery import attempts
from tasks.delivery import signing
from tasks.delivery import url_policy
from tasks.delivery.events import record
from tasks.worker import metrics
from tests.helpers import (counted, deliveries, delivery, make_call, progress_event, row, wait_delivered,
                           wait_status)
from tests.tasklog import TaskLog

SEND = "tools.send_email."
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def task_log():
    with TaskLog() as log:
        yield log


class RawServer:
    """An HTTP endpoint answering every POST with fixed bytes (what the relay fixture cannot send)."""

    def __init__(self, status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None):
        self.status, self.body, self.extra = status, body, headers or {}
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests += 1
                self.send_response(server.status)
                for name, value in server.extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                self.wfile.write(server.body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/cb"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def raw():
    made: list[RawServer] = []

    def _raw(*args: Any, **kw: Any) -> RawServer:
        made.append(RawServer(*args, **kw))
        return made[-1]

    yield _raw
    for server in made:
        server.close()








def make_due(event_id: str) -> None:
    with db.session() as s:
        s.execute(text("UPDATE callback_deliveries SET next_attempt_at = now() - interval '1 second' "
                       "WHERE event_id = :e"), {"e": event_id})


def outbox_count() -> int:
    with db.session() as s:
        return len(s.scalars(select(EmailOutbox)).all())


# -- signing, headers, order ---------------------------------------------------------------

def test_sign_is_hmac_sha256_over_timestamp_dot_body():
    body = b'{"event":"progress"}'
    expected = hmac.new(b"k", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert signing.sign("k", "1700000000", body) == f"sha256={expected}"


SIGNED_AT = 1_700_000_000
BODY = b'{"event":"progress","seq":1}'


def _headers(secret: str = "k", at: int = SIGNED_AT, body: bytes = BODY) -> dict[str, str]:
    return {"X-Voice-Tools-Timestamp": str(at), "X-Voice-Tools-Signature": signing.sign(secret, str(at), body)}


def test_verify_accepts_a_good_signature_from_headers_or_values():
    headers = _headers()
    assert signing.verify("k", headers, BODY, now=SIGNED_AT)
    assert signing.verify("k", {name.lower(): value for name, value in headers.items()}, BODY, now=SIGNED_AT)
    assert signing.verify("k", (headers["X-Voice-Tools-Timestamp"], headers["X-Voice-Tools-Signature"]), BODY,
                          now=SIGNED_AT)
    signed_now = _headers(at=int(time.time()))
    assert signing.verify("k", signed_now, BODY)  # ``now`` defaults to the clock


def test_verify_refuses_a_wrong_secret_and_a_tampered_body():
    assert not signing.verify("not-k", _headers(), BODY, now=SIGNED_AT)
    assert not signing.verify("k", _headers(), BODY.replace(b"1", b"2"), now=SIGNED_AT)
    assert not signing.verify("k", _headers(), BODY + b" ", now=SIGNED_AT)
    assert not signing.verify("", _headers(secret=""), BODY, now=SIGNED_AT)  # an empty secret verifies nothing
    # the timestamp is signed too: the same signature with another timestamp is refused
    moved = dict(_headers(), **{"X-Voice-Tools-Timestamp": str(SIGNED_AT + 1)})
    assert not signing.verify("k", moved, BODY, now=SIGNED_AT)


@pytest.mark.parametrize("offset, accepted", [
    (0, True), (300, True), (-300, True),  # within the window, either side
    (301, False),  # stale: a replay of an old request
    (-301, False),  # from the future
    (86_400, False),
])
def test_verify_refuses_a_timestamp_outside_the_window(offset, accepted):
    assert signing.verify("k", _headers(), BODY, now=SIGNED_AT + offset) is accepted
    assert signing.verify("k", _headers(), BODY, tolerance_s=10, now=SIGNED_AT + offset) is (offset == 0)


@pytest.mark.parametrize("timestamp, signature", [
    (None, "good"), (str(SIGNED_AT), None), ("", "good"), (str(SIGNED_AT), ""),
    ("17e8", "good"), ("-1700000000", "good"), (" 1700000000", "good"), ("\u0661\u0667", "good"),
    (str(SIGNED_AT), "bare"),  # the hex without its ``sha256=``
    (str(SIGNED_AT), "sha1=" + "0" * 40), (str(SIGNED_AT), "sha256=" + "0" * 64),
    (str(SIGNED_AT), "sha256=nothex"), (str(SIGNED_AT), "sha256=\u00e9t\u00e9"),
])
def test_verify_refuses_a_missing_or_malformed_header(timestamp, signature):
    good = _headers()["X-Voice-Tools-Signature"]
    headers = {}
    if timestamp is not None:
        headers["X-Voice-Tools-Timestamp"] = timestamp
    if signature is not None:
        headers["X-Voice-Tools-Signature"] = {"good": good, "bare": good.removeprefix("sha256=")}.get(
            signature, signature)
    assert signing.verify("k", headers, BODY, now=SIGNED_AT) is False


def test_signing_is_light_to_import():
    """A relay's receiver (the demo's) imports it in a process with no Celery and no database."""
    done = subprocess.run([sys.executable, "-c", "import sys, tasks.delivery.signing; "
                           "print(sorted({'celery', 'sqlalchemy', 'kombu', 'requests', 'flask'} & set(sys.modules)))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- Standard Webhooks ------------------------------------------------------------------------

NEW_SECRET = "whsec_" + base64.b64encode(b"n" * 32).decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"o" * 32).decode()


def _standard(secrets: list[str], at: int = SIGNED_AT, body: bytes = BODY, msg_id: str = "e" * 32) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(at),
            "webhook-signature": signing.sign_standard(secrets, msg_id, str(at), body)}


def test_sign_standard_is_the_schemes_own_and_carries_one_signature_per_secret():
    """The ``standardwebhooks`` package's own Webhook.verify accepts it, for each secret of a rotation."""
    now = int(time.time())
    headers = _standard([NEW_SECRET, OLD_SECRET], at=now)
    parts = headers["webhook-signature"].split(" ")
    assert len(parts) == 2 and all(re.fullmatch(r"v1,[A-Za-z0-9+/]{43}=", part) for part in parts)
    assert parts[0] == signing.sign_standard([NEW_SECRET], "e" * 32, str(now), BODY)  # newest first
    for secret in (NEW_SECRET, OLD_SECRET):
        assert Webhook(secret).verify(BODY, headers) == json.loads(BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + base64.b64encode(b"x" * 32).decode()).verify(BODY, headers)
    expected = base64.b64encode(hmac.new(b"n" * 32, f"{'e' * 32}.{now}.".encode() + BODY,
                                         hashlib.sha256).digest()).decode()
    assert parts[0] == f"v1,{expected}"  # HMAC-SHA256 over id.timestamp.body, keyed with the decoded secret
    with pytest.raises(ValueError):
        signing.sign_standard(["not-a-whsec"], "e" * 32, str(now), BODY)
    with pytest.raises(ValueError):
        signing.sign_standard([], "e" * 32, str(now), BODY)


def test_verify_standard_accepts_any_secret_of_a_rotation_and_refuses_a_tampered_body():
    headers = _standard([NEW_SECRET, OLD_SECRET])
    for held in ([NEW_SECRET], [OLD_SECRET], OLD_SECRET, [OLD_SECRET, NEW_SECRET]):
        assert signing.verify_standard(held, headers, BODY, now=SIGNED_AT), held
    assert signing.verify_standard(NEW_SECRET, {k.upper(): v for k, v in headers.items()}, BODY, now=SIGNED_AT)
    assert signing.verify_standard(NEW_SECRET, _standard([NEW_SECRET], at=int(time.time())), BODY)  # the clock
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    assert not signing.verify_standard(other, headers, BODY, now=SIGNED_AT)
    assert not signing.verify_standard(NEW_SECRET, headers, BODY.replace(b"1", b"2"), now=SIGNED_AT)
    assert not signing.verify_standard(NEW_SECRET, headers, BODY + b" ", now=SIGNED_AT)
    assert not signing.verify_standard(NEW_SECRET, dict(headers, **{"webhook-id": "f" * 32}), BODY, now=SIGNED_AT)
    moved = dict(headers, **{"webhook-timestamp": str(SIGNED_AT + 1)})  # the timestamp is signed too
    assert not signing.verify_standard(NEW_SECRET, moved, BODY, now=SIGNED_AT + 1)
    assert not signing.verify_standard([], headers, BODY, now=SIGNED_AT)
    assert not signing.verify_standard("", headers, BODY, now=SIGNED_AT)
    assert not signing.verify_standard("not-a-whsec", headers, BODY, now=SIGNED_AT)


@pytest.mark.parametrize("offset, accepted", [
    (0, True), (300, True), (-300, True), (301, False), (-301, False), (86_400, False), (-10 ** 12, False),
])
def test_verify_standard_refuses_a_timestamp_outside_the_window(offset, accepted):
    headers = _standard([NEW_SECRET])
    assert signing.verify_standard(NEW_SECRET, headers, BODY, now=SIGNED_AT + offset) is accepted
    assert signing.verify_standard(NEW_SECRET, headers, BODY, tolerance_s=10, now=SIGNED_AT + offset) is (offset == 0)


@pytest.mark.parametrize("name, value", [
    ("webhook-id", None), ("webhook-timestamp", None), ("webhook-signature", None),
    ("webhook-id", ""), ("webhook-timestamp", ""), ("webhook-signature", ""),
    ("webhook-timestamp", "17e8"), ("webhook-timestamp", "1700000000.0"), ("webhook-timestamp", "\u0661\u0667"),
    ("webhook-signature", "v2,good"), ("webhook-signature", "good"), ("webhook-signature", "v1,not base64!"),
    ("webhook-signature", "v1," + base64.b64encode(b"0" * 32).decode()),
])
def test_verify_standard_refuses_a_missing_or_malformed_header(name, value):
    headers = _standard([NEW_SECRET])
    good = headers["webhook-signature"].removeprefix("v1,")
    if value is None:
        del headers[name]
    else:
        headers[name] = value.replace("good", good)
    assert signing.verify_standard(NEW_SECRET, headers, BODY, now=SIGNED_AT) is False
    assert signing.verify_standard(NEW_SECRET, _standard([NEW_SECRET]), b"\xff", now=SIGNED_AT) is False


@pytest.mark.parametrize("secret, reason", [
    (NEW_SECRET, None),
    ("whsec_" + base64.b64encode(b"k" * 24).decode().rstrip("="), None),  # unpadded base64 is fine
    ("n" * 44, "does not start with whsec_"),
    ("whsec_not*base64", "is not whsec_ followed by base64"),
    ("whsec_" + base64.b64encode(b"k" * 16).decode(), "holds a key of 16 bytes (24 to 64 wanted)"),
    ("whsec_", "holds a key of 0 bytes (24 to 64 wanted)"),
])
def test_a_standard_secret_is_whsec_and_base64(secret, reason):
    assert signing.secret_error(secret) == reason
    assert signing.secret_error(signing.new_secret()) is None


# docs/relay-guide.md, Event fields: every callback body carries these (null where they do not apply)
EVENT_FIELDS = {
    "event_id", "type", "event", "tool_call_id", "intent_id", "session_id", "function_name", "parameters",
    "status", "step", "gate", "progress", "message", "cancellable", "requires_confirmation", "preview",
    "resume_url", "actions_available", "result", "voice_response", "execution_time_ms", "context_available",
    "context_key", "seq", "sent_at",
}


def test_every_event_is_signed_ordered_and_identified(worker, relay):
    relay.answer(lambda event: {"continue": True})
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "completed")
    assert row(call.tool_call_id).status == "COMPLETED"

    received, headers = relay.events_for(call.tool_call_id), relay.headers
    assert len(received) == 4 == len(headers) and relay.bad_signatures == 0
    for event, head in zip(received, headers):
        assert head["X-Voice-Tools-Event"] == event["event"]
        assert head["X-Voice-Tools-Event-Id"] == event["event_id"]
        assert re.fullmatch(r"sha256=[0-9a-f]{64}", head["X-Voice-Tools-Signature"])
        assert head["X-Voice-Tools-Timestamp"].isdigit()
        assert abs(int(head["X-Voice-Tools-Timestamp"]) - time.time()) < 300
        # Standard Webhooks beside them: the event's id, the same timestamp
        assert head["webhook-id"] == event["event_id"]
        assert head["webhook-timestamp"] == head["X-Voice-Tools-Timestamp"]
        assert re.fullmatch(r"v1,[A-Za-z0-9+/]{43}=", head["webhook-signature"])
        assert event["type"] == "tool_status" and event["tool_call_id"] == call.tool_call_id
        assert event["session_id"] == "sess_test" and event["function_name"] == "send_email"
        assert datetime.fromisoformat(event["sent_at"])
        assert EVENT_FIELDS <= set(event), EVENT_FIELDS - set(event)
    seqs = [e["seq"] for e in received]
    assert all(a < b for a, b in zip(seqs, seqs[1:])), seqs
    assert len({e["event_id"] for e in received}) == 4
    rows = deliveries(call.tool_call_id)
    assert [(d.event_id, d.seq, d.event) for d in rows] == [(e["event_id"], e["seq"], e["event"]) for e in received]
    # the scheme's own library accepts every callback
    [secret] = signing.parse_secrets(os.environ["VOICE_TOOLS_CALLBACK_SECRETS"])
    for event, head, body in zip(received, headers, relay.bodies):
        assert Webhook(secret).verify(body, head) == event


def test_during_a_rotation_every_callback_verifies_with_either_secret(relay, monkeypatch):
    """VOICE_TOOLS_CALLBACK_SECRETS=new,old: one v1 signature per secret, newest first; the relay
    holding the old one and the relay holding the new one both verify it (standardwebhooks' own
    Webhook.verify, and verify_standard), the older headers stay signed with VOICE_TOOLS_CALLBACK_SECRET."""
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRETS", f"{NEW_SECRET}, {OLD_SECRET}")
    relay.webhook_secrets = [OLD_SECRET]  # a relay not yet given the new secret
    _, event_id = progress_event(relay.url)
    assert attempts.attempt(event_id).delivered and relay.bad_signatures == 0
    [head], [body] = relay.headers, relay.bodies
    assert head["webhook-id"] == event_id and len(head["webhook-signature"].split(" ")) == 2
    for secret in (NEW_SECRET, OLD_SECRET):
        assert Webhook(secret).verify(body, head)["event_id"] == event_id
        assert signing.verify_standard(secret, head, body)
    assert signing.verify(os.environ["VOICE_TOOLS_CALLBACK_SECRET"], head, body)
    # once the rotation is over (old secret removed), the relay still holding only the old one refuses
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRETS", NEW_SECRET)
    _, second = progress_event(relay.url)
    assert not attempts.attempt(second).delivered and relay.bad_signatures == 1
    relay.webhook_secrets = [NEW_SECRET]
    make_due(second)
    assert attempts.attempt(second).delivered and relay.bad_signatures == 1


def test_the_relay_refuses_a_tampered_body_or_a_replayed_callback(relay):
    """What a relay's check refuses, on a real callback: the body changed, or the same request
    sent again past the replay window."""
    _, event_id = progress_event(relay.url)
    assert attempts.attempt(event_id).delivered
    [head], [body] = relay.headers, relay.bodies
    [secret] = relay.webhook_secrets
    sent_at = int(head["webhook-timestamp"])
    assert signing.verify_standard(secret, head, body, now=sent_at + 300)
    assert not signing.verify_standard(secret, head, body.replace(b'"progress"', b'"completed"', 1))
    assert not signing.verify_standard(secret, head, body, now=sent_at + 301)  # stale: a replay
    assert not signing.verify(relay.secret, head, body, now=sent_at + 301)


def test_the_relay_catches_a_wrong_signature(relay, monkeypatch):
    _, event_id = progress_event(relay.url)
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRET", "not-the-relays-secret")
    answer = attempts.attempt(event_id)
    assert not answer.delivered and relay.bad_signatures == 1
    found = delivery(event_id)
    assert (found.state, found.attempts, found.response_code, found.last_error) == ("pending", 1, 401, "HTTP 401")


# -- retries ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_failed_delivery_is_retried_on_the_callbacks_queue(worker, relay, task_log):
    answered: list[str] = []

    def first_fails(event):
        answered.append(event["event_id"])
        return 500 if len(answered) == 1 else None

    relay.answer(first_fails)
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")  # the chain did not wait for the failed event
    event_id = answered[0]
    done = wait_delivered(event_id)
    assert done.event == "progress" and done.attempts == 2 and done.response_code == 200
    assert done.last_error is None and done.delivered_at is not None and done.next_attempt_at is None
    assert [(a["response_code"], a["error"]) for a in done.attempt_log] == [(500, "HTTP 500"), (200, None)]
    assert answered.count(event_id) == 2  # the same event_id: the relay can drop duplicates
    retries = task_log.published_for(event_id, "callbacks.deliver")
    assert len(retries) == 1 and retries[0].queue == "callbacks" and retries[0].eta
    task_log.wait_ran(event_id, "callbacks.deliver")


def test_a_retry_that_is_not_due_does_nothing(raw):
    server = raw(500)
    _, event_id = progress_event(server.url)
    assert attempts.attempt(event_id).attempted
    first = delivery(event_id)
    assert first.state == "pending" and first.next_attempt_at is not None
    with db.session() as s:  # a long backoff, so the check below cannot race the clock
        s.execute(text("UPDATE callback_deliveries SET next_attempt_at = now() + interval '1 minute'"))
    # A duplicate retry message (redelivered, or re-sent by the sweep) before the row is due:
    again = attempts.attempt(event_id)
    assert (again.attempted, again.delivered) == (False, False)
    assert server.requests == 1 and delivery(event_id).attempts == 1


def test_attempts_stop_at_the_maximum(raw, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_MAX_ATTEMPTS", "2")
    metrics.start_recording()  # as a worker does: each attempt is counted by its outcome
    before = {outcome: counted("voice_tools_callback_attempts_total", event="progress", outcome=outcome)
              for outcome in ("will_retry", "gave_up")}
    server = raw(503)
    _, event_id = progress_event(server.url)
    attempts.attempt(event_id)
    make_due(event_id)
    attempts.attempt(event_id)
    failed = delivery(event_id)
    assert (failed.state, failed.attempts, failed.next_attempt_at) == ("failed", 2, None)
    assert {outcome: counted("voice_tools_callback_attempts_total", event="progress", outcome=outcome) - number
            for outcome, number in before.items()} == {"will_retry": 1, "gave_up": 1}
    assert [a["response_code"] for a in failed.attempt_log] == [503, 503]
    assert attempts.attempt(event_id).attempted is False
    assert server.requests == 2


def test_the_deliver_tasks_state_says_a_delivery_that_ended_failed(raw, monkeypatch):
    """What Flower shows: ``callbacks.deliver`` fails (FAILURE) on the attempt that gives the delivery up,
    and succeeds on one that leaves it to a retry, or that finds nothing to do."""
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_MAX_ATTEMPTS", "2")
    monkeypatch.setattr(attempts, "schedule_retry", lambda event_id: None)  # the retry's message is not the point
    server = raw(503)
    _, event_id = progress_event(server.url)
    first = attempts.deliver.apply((event_id,))
    assert (first.state, first.result) == ("SUCCESS", "retry")  # one more attempt to come: not failed yet
    make_due(event_id)
    last = attempts.deliver.apply((event_id,))
    assert last.state == "FAILURE" and isinstance(last.result, attempts.DeliveryFailed)
    assert str(last.result) == f"callback {event_id} given up after 2 attempts: HTTP 503"
    assert delivery(event_id).state == "failed"
    again = attempts.deliver.apply((event_id,))  # a duplicate of the message: nothing to do, not a failure
    assert (again.state, again.result) == ("SUCCESS", "skipped")
    assert server.requests == 2


def test_a_redirect_is_a_failed_attempt_and_is_not_followed(relay, raw):
    server = raw(307, b"", {"Location": relay.url})
    tool_call_id, event_id = progress_event(server.url)
    answer = attempts.attempt(event_id)
    assert not answer.delivered
    found = delivery(event_id)
    assert (found.state, found.response_code, found.last_error) == ("pending", 307, "HTTP 307")
    assert server.requests == 1 and relay.events == []
    assert row(tool_call_id).status == "EXECUTING"


# -- the relay's answer ------------------------------------------------------------------------

def test_cancel_answer_to_a_cancellable_progress_event_cancels(worker, relay, task_log):
    relay.answer(lambda e: {"cancel": True, "reason": "Caller said stop"} if e["step"] == "PREPARING" else None)
    cancelled_before = counted("voice_tools_calls_ended_total", tool="send_email", status="CANCELLED")
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "cancelled")
    task_log.wait_ran(call.tool_call_id, SEND + "PREPARING")  # which would have done the checkpoint
    done = row(call.tool_call_id)
    assert done.status == "CANCELLED" and done.error_message == "Caller said stop"
    assert task_log.published_for(call.tool_call_id, SEND + "READY_TO_SEND") == []
    assert [e["status"] for e in done.status_history] == ["PENDING", "EXECUTING", "CANCELLED"]
    assert task_log.published_for(call.tool_call_id, SEND + "SENDING") == []
    assert [d.event for d in deliveries(call.tool_call_id)] == ["progress", "cancelled"]
    assert outbox_count() == 0
    # the worker ended it (the relay's answer): counted there, once its transaction committed
    assert counted("voice_tools_calls_ended_total", tool="send_email", status="CANCELLED") == cancelled_before + 1


def test_cancel_answer_to_the_checkpoint_cancels(worker, relay):
    relay.answer(lambda e: {"cancel": True} if e["event"] == "checkpoint" else None)
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "cancelled")
    done = row(call.tool_call_id)
    assert done.status == "CANCELLED" and done.error_message == "Cancelled by the relay"
    assert len(deliveries(call.tool_call_id, "cancelled")) == 1 and outbox_count() == 0


@pytest.mark.slow
def test_cancel_answer_to_a_retried_delivery_cancels_while_still_cancellable(worker, relay):
    seen: list[str] = []

    def answer(event):
        if event["step"] != "PREPARING":
            return None
        seen.append(event["event_id"])
        return 500 if len(seen) == 1 else {"cancel": True, "reason": "Too slow"}

    relay.answer(answer)
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "cancelled")
    done = row(call.tool_call_id)
    assert done.status == "CANCELLED" and done.error_message == "Too slow" and outbox_count() == 0


def test_cancel_answer_to_a_non_cancellable_event_is_ignored(worker, relay):
    relay.answer(lambda e: {"cancel": True} if e["step"] == "SENDING" else None)
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "completed")
    sending = [e for e in relay.events_for(call.tool_call_id) if e["step"] == "SENDING"]
    assert [e["cancellable"] for e in sending] == [False]
    assert row(call.tool_call_id).status == "COMPLETED" and outbox_count() == 1
    assert deliveries(call.tool_call_id, "cancelled") == []


@pytest.mark.slow
@pytest.mark.parametrize("status, body", [
    (200, b'{"continue": true}'),
    (200, b'{"received": true}'),
    (200, b""),
    (204, b""),
    (200, b"cancel"),
    (200, b'{"cancel": false}'),
    (200, b'{"cancel": "yes"}'),
    (200, b'["cancel", true]'),
    (500, b'{"cancel": true}'),
])
def test_any_other_answer_lets_the_call_go_on(raw, status, body):
    tool_call_id, event_id = progress_event(raw(status, body).url)
    answer = attempts.attempt(event_id)
    assert answer.cancel is False
    assert answer.delivered is (status < 300)
    assert row(tool_call_id).status == "EXECUTING"


def test_the_same_server_answering_cancel_does_cancel(raw):
    """The control for the test above: the only difference is the answer."""
    tool_call_id, event_id = progress_event(raw(200, json.dumps({"cancel": True}).encode()).url)
    assert attempts.attempt(event_id).cancel is True
    assert row(tool_call_id).status == "CANCELLED"


def test_the_cancelled_event_is_sent_once_however_many_cancel(worker, relay):
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    barrier, results = threading.Barrier(20), []

    def cancel():
        barrier.wait()
        try:
            actions.cancel(call.tool_call_id)
            results.append("ok")
        except lifecycle.Refused as exc:
            results.append(exc.code)

    threads = [threading.Thread(target=cancel) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == ["already_terminal"] * 19 + ["ok"]
    relay.wait_for(call.tool_call_id, "cancelled")
    [cancelled] = deliveries(call.tool_call_id, "cancelled")
    wait_delivered(cancelled.event_id)
    assert [e["event_id"] for e in relay.events_for(call.tool_call_id) if e["event"] == "cancelled"] == [
        cancelled.event_id]


# -- slow relays ------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_slow_relay_does_not_hold_the_chain(worker, relay, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "0.3")
    held, release = [], threading.Event()

    def hold_the_first(event):
        if not held:
            held.append(event["event_id"])
            release.wait(20)
        return None

    relay.answer(hold_the_first)
    call = make_call(callback_url=relay.url)
    try:
        actions.confirm(call.tool_call_id)
        # The relay is still sitting on the first event, and the chain went on.
        wait_status(call.tool_call_id, "PREPARED")
        assert not release.is_set()
        actions.resume(call.tool_call_id)
        wait_status(call.tool_call_id, "COMPLETED")
    finally:
        release.set()
    done = wait_delivered(held[0])
    assert done.attempts >= 2 and "Timeout" in done.attempt_log[0]["error"]
    assert outbox_count() == 1


@pytest.mark.slow
def test_a_relay_always_slower_than_the_inline_timeout_still_gets_every_event(worker, relay, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "0.2")
    relay.delay = 0.6
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    wait_status(call.tool_call_id, "COMPLETED")
    rows = deliveries(call.tool_call_id)
    assert [d.event for d in rows] == ["progress", "checkpoint", "progress", "completed"]
    for d in rows:
        done = wait_delivered(d.event_id)
        assert done.attempts == 2 and "Timeout" in done.attempt_log[0]["error"]
        assert done.attempt_log[1] == {**done.attempt_log[1], "response_code": 200, "error": None}


# -- which URLs may be called --------------------------------------------------------------------

@pytest.mark.parametrize("url, allowed, error", [
    ("https://relay.example.com/cb", ["relay.example.com"], None),
    ("https://RELAY.example.com:9443/cb", ["relay.example.com"], None),  # a bare host admits any port
    ("https://relay.example.com:8443/cb", ["relay.example.com:8443"], None),
    ("https://relay.example.com/cb", ["relay.example.com:8443"], "not in"),  # 443 is not 8443
    ("http://relay.example.com:9000/cb", ["relay.example.com:8443"], "not in"),
    ("https://evil.example.com/cb", ["relay.example.com"], "host evil.example.com is not in"),
    ("https://relay.example.com.evil.com/cb", ["relay.example.com"], "not in"),
    ("https://relay.example.com@evil.com/cb", ["relay.example.com"], "must not hold credentials"),
    ("https://8.8.8.8/cb", ["relay.example.com"], "not in"),
    ("http://10.1.2.3/cb", ["relay.example.com"], "private"),
    ("http://192.168.0.7:8080/cb", [], "private"),
    ("http://127.0.0.1:5000/cb", ["localhost"], "private"),
    ("http://169.254.169.254/latest/meta-data", ["relay.example.com"], "private"),
    ("http://[::1]:8080/cb", [], "private"),
    ("http://10.1.2.3/cb", ["10.1.2.3"], None),  # listed itself
    ("http://127.0.0.1:5000/cb", ["127.0.0.1:5000"], None),
    ("http://[::1]:8080/cb", ["[::1]:8080"], None),
    ("http://[::1]:8080/cb", ["::1"], None),
    ("ftp://relay.example.com/cb", ["relay.example.com"], "http or https"),
    ("file:///etc/passwd", ["relay.example.com"], "http or https"),
    ("javascript:alert(1)", ["relay.example.com"], "http or https"),
    ("https:///cb", ["relay.example.com"], "http or https"),
    ("https://relay.example.com:99999/cb", ["relay.example.com"], "not a valid URL"),
])
def test_url_error(url, allowed, error):
    found = url_policy.url_error(url, allowed)
    if error is None:
        assert found is None
    else:
        assert found is not None and error in found


def test_url_error_reads_the_allowed_hosts_from_the_environment(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "relay.example.com, hooks.example.org:8443")
    assert url_policy.url_error("https://hooks.example.org:8443/x") is None
    assert url_policy.url_error("https://hooks.example.org/x") is not None
    assert url_policy.url_error("http://127.0.0.1/x") is not None


# -- a link's event, recorded by its transition's own statement, is the one record() writes ----------

def _twin_payloads(tool_call_id: str, transition: Any, name: str, **given: Any) -> tuple[Any, Any]:
    """The event recorded by ``transition(s, event=events.event(name, ...))`` and the one
    ``tasks.delivery.events.record`` writes for the row as that transition left it (the next seq)."""
    progress = given.pop("progress")
    with db.statement() as s:
        moved = transition(s, events.event(name, progress=progress, **given))
    assert moved is not None and moved.delivery_url is not None
    with db.session() as s:
        record(s, queries.get(s, tool_call_id), name, **given)
    first, second = deliveries(tool_call_id)[-2:]
    assert first.event_id == moved.delivery_event_id and second.seq == first.seq + 1
    return first, second


@pytest.mark.parametrize("ending", ["progress", "checkpoint", "completed"])
def test_the_event_a_link_records_with_its_transition_is_the_one_record_writes(relay, ending):
    call = make_call(callback_url=relay.url, callback_urls={"completed": f"{relay.base}/done"},
                     intent_id="intent_1")
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
    with db.statement() as s:
        assert lifecycle.begin_step(s, call.tool_call_id, "PREPARING", 0.0) is not None
    id_ = call.tool_call_id
    if ending == "progress":
        first, second = _twin_payloads(
            id_, lambda s, ev: lifecycle.record_step(s, id_, "PREPARING", {"draft": 1}, 0.25, event=ev), "progress",
            step="PREPARING", gate=1, progress=0.25, message="Preparing.", inline=True)
    elif ending == "checkpoint":
        first, second = _twin_payloads(
            id_, lambda s, ev: lifecycle.checkpoint(s, id_, "READY_TO_SEND", 0.5, output={"to": "x"}, event=ev),
            "checkpoint", step="READY_TO_SEND", gate=2, progress=0.5, message="Send it?", requires_confirmation=True, preview={"to": "x"}, inline=True)
    else:
        first, second = _twin_payloads(
            id_, lambda s, ev: lifecycle.complete(s, id_, {"ok": True}, "Done.", context_key="k1", event=ev),
            "completed", step="COMPLETED", gate=4, progress=1.0, message="Done.", context_key="k1", inline=True)
    mine = {k: v for k, v in first.payload.items() if k not in ("event_id", "seq")}
    theirs = {k: v for k, v in second.payload.items() if k not in ("event_id", "seq")}
    assert mine == theirs
    assert (first.payload["event_id"], first.payload["seq"]) == (first.event_id, first.seq)
    assert (first.url, first.state, first.attempts, first.session_id, first.event) == \
        (second.url, second.state, second.attempts, second.session_id, second.event)
    assert first.next_attempt_at is not None and second.next_attempt_at is not None
    assert row(id_).event_seq == second.seq
