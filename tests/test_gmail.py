"""send_email on Gmail: the backend and the tool end to end.

Backend unit tests drive the real google-api-python-client against
``HttpMockSequence`` and assert on each request (method, path, query, the decoded raw
MIME). End-to-end tests run the tool through the in-process worker against the
``google_api`` HTTP double (a real local server the product is configured to use).
The slow test SIGKILLs the prefork child that is inside the send and shows that the
redelivered link finds the message instead of sending it again.
"""
from __future__ import annotations

import base64
import email
import json
import time
from email.policy import default as default_policy
from urllib.parse import parse_qs, urlsplit

import psutil
import pytest
from googleapiclient.http import HttpMockSequence
from sqlalchemy import func, select

from models import db
from models.email import EmailOutbox
from tasks import app, tools
from tasks.calls import actions
from backends import email as local_email
from backends import gmail, google
from tests.google_fixtures import google_env
from tests.helpers import make_call, row, wait_status
from support.worker_process import WorkerProcess, queues_taken_from_others

LIST = r"^/gmail/v1/users/me/messages$"
SEND = r"^/gmail/v1/users/me/messages/send$"
DRAFT = {"to": "john@example.com", "cc": ["ann@example.com", "bob@example.com"], "subject": "Q3 numbers",
         "body": "Hi John,\nthe Q3 numbers are in.", "message_id": local_email.message_id_for("tc_0123456789ab")}


def mime_of(raw: str) -> email.message.EmailMessage:
    return email.message_from_bytes(base64.urlsafe_b64decode(raw), policy=default_policy)


def text_of(message: email.message.EmailMessage) -> str:
    return message.get_content().replace("\r\n", "\n").rstrip("\n")


def error_body(status: int, message: str, reason: str) -> dict:
    return {"error": {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}}


def mock(*answers: tuple[int, object]) -> HttpMockSequence:
    return HttpMockSequence([({"status": str(status)}, json.dumps(body)) for status, body in answers])


def gmail_client(http: HttpMockSequence):
    return google.build_service("gmail", "v1", http=http)


def outbox_count() -> int:
    with db.session() as s:
        return s.scalar(select(func.count()).select_from(EmailOutbox))


# -- the backend, request by request ---------------------------------------------------------

def test_send_looks_the_message_id_up_then_sends_the_mime_message():
    http = mock((200, {"resultSizeEstimate": 0}), (200, {"id": "18c9f", "threadId": "18c9e", "labelIds": ["SENT"]}))
    sent = gmail.send("tc_0123456789ab", DRAFT, service=gmail_client(http))
    assert sent == {"message_id": "18c9f", "thread_id": "18c9e", "to": "john@example.com"}

    (list_uri, list_method, _, _), (send_uri, send_method, send_body, send_headers) = http.request_sequence
    lookup = urlsplit(list_uri)
    assert (list_method, lookup.path) == ("GET", "/gmail/v1/users/me/messages")
    query = parse_qs(lookup.query)
    assert query["q"] == ["rfc822msgid:tc_0123456789ab@voice-tools.local"]
    assert query["includeSpamTrash"] == ["true"]

    assert (send_method, urlsplit(send_uri).path) == ("POST", "/gmail/v1/users/me/messages/send")
    assert send_headers["content-type"].startswith("application/json")
    payload = json.loads(send_body)
    assert list(payload) == ["raw"]
    message = mime_of(payload["raw"])
    assert message["To"] == "john@example.com"
    assert message["Cc"] == "ann@example.com, bob@example.com"
    assert message["Subject"] == "Q3 numbers"
    assert message["Message-ID"] == "<tc_0123456789ab@voice-tools.local>"
    assert message.get_content_type() == "text/plain"
    assert text_of(message) == "Hi John,\nthe Q3 numbers are in."


def test_mime_message_encodes_non_ascii_and_leaves_out_an_empty_cc():
    draft = {**DRAFT, "cc": [], "subject": "Résumé für Q3", "body": "Café ☕ at 3pm"}
    raw = base64.urlsafe_b64decode(gmail.raw_of(draft))
    assert raw.isascii() and b"\r\n" in raw  # 7-bit transport, CRLF lines
    message = mime_of(gmail.raw_of(draft))
    assert message["Cc"] is None
    assert message["Subject"] == "Résumé für Q3" and text_of(message) == "Café ☕ at 3pm"


def test_a_message_already_in_the_mailbox_is_returned_and_not_sent_again():
    http = mock((200, {"messages": [{"id": "18caa", "threadId": "18ca0"}], "resultSizeEstimate": 1}))
    sent = gmail.send("tc_0123456789ab", DRAFT, service=gmail_client(http))
    assert sent == {"message_id": "18caa", "thread_id": "18ca0", "to": "john@example.com"}
    assert [(urlsplit(uri).path, method) for uri, method, _, _ in http.request_sequence] == [
        ("/gmail/v1/users/me/messages", "GET")]


@pytest.mark.parametrize("answers, raised, said", [
    # the send is refused: nothing was sent
    ([(200, {}), (400, error_body(400, "Invalid To header", "invalidArgument"))], gmail.Refused, "Invalid To header"),
    # the lookup is refused (gmail.readonly missing): the send is never tried
    ([(403, error_body(403, "Request had insufficient authentication scopes.", "insufficientPermissions"))],
     gmail.Refused, "Request had insufficient authentication scopes."),
    # a 403 rate limit is worth retrying
    ([(200, {}), (403, error_body(403, "User-rate limit exceeded", "userRateLimitExceeded"))],
     gmail.Unavailable, "Gmail rate limit: User-rate limit exceeded"),
])
def test_google_answers_are_turned_into_what_they_mean(answers, raised, said):
    http = mock(*answers)
    with pytest.raises(raised) as caught:
        gmail.send("tc_0123456789ab", DRAFT, service=gmail_client(http))
    assert str(caught.value) == said
    assert len(http.request_sequence) == len(answers)
    # the engine retries what the backend says is unavailable and fails the call on a refusal
    assert tools.is_transient(caught.value) == (raised is gmail.Unavailable)


def test_a_5xx_goes_through_for_the_engine_to_retry():
    http = mock((200, {}), (503, error_body(503, "Backend Error", "backendError")))
    with pytest.raises(google.HttpError) as caught:
        gmail.send("tc_0123456789ab", DRAFT, service=gmail_client(http))
    assert google.status_of(caught.value) == 503 and tools.is_transient(caught.value)


def test_gmail_scopes_allow_the_send_and_the_message_id_search():
    assert set(google.SCOPES["gmail"]) == {"https://www.googleapis.com/auth/gmail.send",
                                           "https://www.googleapis.com/auth/gmail.readonly"}


# -- the tool, end to end through a worker and the Google double ------------------------------

def test_send_email_on_gmail_checkpoint_resume_completed(worker, relay, google_api):
    google_api.answer("GET", LIST, {"resultSizeEstimate": 0})
    google_api.answer("POST", SEND, {"id": "gm-msg-1", "threadId": "gm-thr-1", "labelIds": ["SENT"]})
    call = make_call(callback_url=relay.url, parameters={
        "to": "john@example.com", "cc": ["ann@example.com"], "subject": "Meeting Tomorrow", "body": "At 3pm."})
    id_ = call.tool_call_id
    actions.confirm(id_)
    checkpoint = relay.wait_for(id_, "checkpoint")
    assert checkpoint["preview"] == {"to": "john@example.com", "cc": ["ann@example.com"],
                                     "subject": "Meeting Tomorrow", "body": "At 3pm."}
    assert wait_status(id_, "PREPARED").committed_at is None
    assert google_api.requests == [], "nothing goes to Gmail before the caller says send"

    actions.resume(id_)
    completed = relay.wait_for(id_, "completed")
    done = row(id_)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    assert done.result == {"message_id": "gm-msg-1", "thread_id": "gm-thr-1", "to": "john@example.com"}
    assert completed["result"] == done.result and done.voice_response == "Email sent to john@example.com."
    tools.TOOLS["send_email"].result_schema().load(done.result)  # the stated shape

    [lookup] = google_api.requests_to("GET", LIST)
    assert lookup.query["q"] == [f"rfc822msgid:{id_}@voice-tools.local"]
    assert lookup.query["includeSpamTrash"] == ["true"]
    assert lookup.headers["authorization"] == "Bearer test-access-token"
    [sent] = google_api.requests_to("POST", SEND)
    message = mime_of(sent.json["raw"])
    assert (message["To"], message["Cc"], message["Subject"]) == ("john@example.com", "ann@example.com",
                                                                  "Meeting Tomorrow")
    assert message["Message-ID"] == f"<{id_}@voice-tools.local>" and text_of(message) == "At 3pm."
    assert outbox_count() == 0, "Gmail, not the local outbox"


@pytest.mark.slow
def test_a_503_whose_send_went_through_is_found_on_retry_and_not_sent_twice(worker, relay, google_api):
    # The first send answers 503 although Gmail did send it: from then on the lookup finds it.
    google_api.answer("GET", LIST, lambda request: (
        {"messages": [{"id": "gm-msg-2", "threadId": "gm-thr-2"}], "resultSizeEstimate": 1}
        if google_api.requests_to("POST", SEND) else {"resultSizeEstimate": 0}), times=None)
    google_api.answer("POST", SEND, error_body(503, "Backend Error", "backendError"), status=503)
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    done = wait_status(call.tool_call_id, timeout=30)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    assert done.result == {"message_id": "gm-msg-2", "thread_id": "gm-thr-2", "to": "john@example.com"}
    assert len(google_api.requests_to("POST", SEND)) == 1, "exactly one send"
    assert len(google_api.requests_to("GET", LIST)) == 2, "looked up before the send and again on the retry"
    assert [e["event"] for e in relay.events_for(call.tool_call_id)].count("completed") == 1


def test_a_refused_send_fails_the_call_saying_it_was_not_sent(worker, relay, google_api):
    google_api.answer("GET", LIST, {"resultSizeEstimate": 0})
    google_api.answer("POST", SEND, error_body(400, "Invalid To header", "invalidArgument"), status=400)
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed")
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and done.error_message == "Invalid To header"
    assert done.voice_response == "The email to john@example.com was not sent: Invalid To header."
    assert failed["voice_response"] == done.voice_response and failed["step"] == "SENDING"
    assert done.committed_at is not None, "it failed at the send itself, past the point of no return"
    assert len(google_api.requests_to("POST", SEND)) == 1, "a refusal is not retried"


# -- a worker dies inside the send -------------------------------------------------------------

QUEUE = "tools.send_email"
SENDING_TASK = "tools.send_email.SENDING"


def child_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_sending_link_redelivered_after_sigkill_finds_the_message_and_does_not_resend(tmp_path):
    from tests.http_double import HttpDouble

    with HttpDouble() as api, queues_taken_from_others(app, [QUEUE]):
        api.answer("GET", LIST, lambda request: (
            {"messages": [{"id": "gm-msg-3", "threadId": "gm-thr-3"}], "resultSizeEstimate": 1}
            if api.requests_to("POST", SEND) else {"resultSizeEstimate": 0}), times=None)
        # Gmail takes the message and then hangs: the link is held inside its side effect.
        api.answer("POST", SEND, {"id": "gm-msg-3", "threadId": "gm-thr-3"}, delay=30)
        env = google_env(api, tmp_path)
        with WorkerProcess(app, [QUEUE], pool="prefork", concurrency=2, log_dir=tmp_path, name="gmail-loss",
                           env=env) as worker:
            call = make_call(parameters={"to": "loss@example.com", "subject": "Worker loss on Gmail"},
                             session_id="sess_gmail_loss")
            id_ = call.tool_call_id
            actions.confirm(id_)
            wait_status(id_, "PREPARED", timeout=60)
            actions.resume(id_)

            first = worker.wait_active(SENDING_TASK, [id_])
            deadline = time.monotonic() + 60
            while not api.requests_to("POST", SEND):
                assert time.monotonic() < deadline, "the send never reached Gmail"
                time.sleep(0.05)
            held = row(id_)
            assert held.status == "EXECUTING" and held.current_step == "SENDING"
            assert held.committed_at is not None, "the link is past the point of no return"
            worker.kill_child(first["worker_pid"])

            deadline = time.monotonic() + 30
            while child_alive(first["worker_pid"]):
                assert time.monotonic() < deadline, "the pool child survived SIGKILL"
                time.sleep(0.05)
            # The redelivered link finds the message at once (too quick to catch with
            # ``inspect active``): the worker's log shows the same message received twice.
            done = wait_status(id_, timeout=60)
            log = worker.log()
        assert done.status == "COMPLETED", (done.status, done.error_message)
        assert done.result == {"message_id": "gm-msg-3", "thread_id": "gm-thr-3", "to": "loss@example.com"}
        assert len(api.requests_to("POST", SEND)) == 1, "one send, although the link ran twice"
        assert len(api.requests_to("GET", LIST)) == 2
        assert done.attempts == 5, "SENDING claimed twice, every other step once"
        assert [h["status"] for h in done.status_history].count("COMPLETED") == 1
        assert "signal 9 (SIGKILL)" in log, log[-3000:]
        assert log.count(f"{SENDING_TASK}[{first['id']}] received") == 2, "the same message, delivered again"
        assert log.count(f"{SENDING_TASK}[{first['id']}] succeeded") == 1, log[-3000:]
