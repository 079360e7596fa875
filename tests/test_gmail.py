"""send_email on Gmail: the backend and the tool end to end.

Backend unit tests drive the real google-api-python-client against
``HttpMockSequence`` and assert on each request (method, path, query, the decoded raw
MIME). End-to-end tests run the tool through the in-process worker against the
``google_api`` HTTP double with ``GmailDouble``'s drafts and mailbox on it (a real local
server the product is configured to use). The slow test SIGKILLs the prefork child that is
inside the send and shows that the redelivered link finds the draft sent and the message in
the mailbox instead of sending it again.
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

from models import db, settings
from models.email import EmailOutbox
from tasks import app, tools
from tasks.calls import actions
from voice_tools_backends import email as local_email
from voice_tools_backends import gmail, google
from tests.google_fixtures import GmailDouble, google_env
from tests.helpers import make_call, row, wait_status
from support.worker_process import WorkerProcess, queues_taken_from_others

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

def test_prepare_looks_the_draft_up_by_message_id_then_creates_it_with_the_mime_message():
    http = mock((200, {"resultSizeEstimate": 0}), (200, {"id": "r-7", "message": {"id": "18c9d"}}))
    assert gmail.prepare(DRAFT, service=gmail_client(http)) == "r-7"

    (list_uri, list_method, _, _), (create_uri, create_method, create_body, create_headers) = http.request_sequence
    lookup = urlsplit(list_uri)
    assert (list_method, lookup.path) == ("GET", "/gmail/v1/users/me/drafts")
    assert parse_qs(lookup.query)["q"] == ["rfc822msgid:" + DRAFT["message_id"].strip("<>")]

    assert (create_method, urlsplit(create_uri).path) == ("POST", "/gmail/v1/users/me/drafts")
    assert create_headers["content-type"].startswith("application/json")
    payload = json.loads(create_body)
    assert list(payload) == ["message"] and list(payload["message"]) == ["raw"]
    message = mime_of(payload["message"]["raw"])
    assert message["To"] == "john@example.com"
    assert message["Cc"] == "ann@example.com, bob@example.com"
    assert message["Subject"] == "Q3 numbers"
    assert message["Message-ID"] == DRAFT["message_id"]
    assert message.get_content_type() == "text/plain"
    assert text_of(message) == "Hi John,\nthe Q3 numbers are in."


def test_prepare_updates_the_draft_it_finds_instead_of_making_a_second():
    http = mock((200, {"drafts": [{"id": "r-7", "message": {"id": "18c9d"}}]}), (200, {"id": "r-7"}))
    assert gmail.prepare({**DRAFT, "body": "New text."}, service=gmail_client(http)) == "r-7"
    (_, _, _, _), (update_uri, update_method, update_body, _) = http.request_sequence
    assert (update_method, urlsplit(update_uri).path) == ("PUT", "/gmail/v1/users/me/drafts/r-7")
    assert text_of(mime_of(json.loads(update_body)["message"]["raw"])) == "New text."


def test_send_sends_the_recorded_draft():
    http = mock((200, {"id": "18c9f", "threadId": "18c9e", "labelIds": ["SENT"]}), (200, {"resultSizeEstimate": 0}))
    sent = gmail.send("tc_0123456789ab", {**DRAFT, "gmail_draft_id": "r-7"}, service=gmail_client(http))
    assert sent == {"message_id": "18c9f", "thread_id": "18c9e", "to": "john@example.com"}
    (send_uri, send_method, send_body, _), (strays_uri, strays_method, _, _) = http.request_sequence
    assert (send_method, urlsplit(send_uri).path) == ("POST", "/gmail/v1/users/me/drafts/send")
    assert json.loads(send_body) == {"id": "r-7"}
    # then no other draft with its Message-ID is left behind
    assert (strays_method, urlsplit(strays_uri).path) == ("GET", "/gmail/v1/users/me/drafts")


def test_mime_message_encodes_non_ascii_and_leaves_out_an_empty_cc():
    draft = {**DRAFT, "cc": [], "subject": "Résumé für Q3", "body": "Café ☕ at 3pm"}
    raw = base64.urlsafe_b64decode(gmail.raw_of(draft))
    assert raw.isascii() and b"\r\n" in raw  # 7-bit transport, CRLF lines
    message = mime_of(gmail.raw_of(draft))
    assert message["Cc"] is None
    assert message["Subject"] == "Résumé für Q3" and text_of(message) == "Café ☕ at 3pm"


def test_a_draft_already_sent_is_found_in_the_mailbox_and_not_sent_again():
    not_found = error_body(404, "Requested entity was not found.", "notFound")
    http = mock((404, not_found), (404, not_found),
                (200, {"messages": [{"id": "18caa", "threadId": "18ca0"}], "resultSizeEstimate": 1}))
    sent = gmail.send("tc_0123456789ab", {**DRAFT, "gmail_draft_id": "r-7"}, service=gmail_client(http))
    assert sent == {"message_id": "18caa", "thread_id": "18ca0", "to": "john@example.com"}
    assert [(urlsplit(uri).path, method) for uri, method, _, _ in http.request_sequence] == [
        ("/gmail/v1/users/me/drafts/send", "POST"), ("/gmail/v1/users/me/drafts/r-7", "GET"),
        ("/gmail/v1/users/me/messages", "GET")]
    lookup = parse_qs(urlsplit(http.request_sequence[2][0]).query)
    assert lookup["q"] == ["rfc822msgid:" + DRAFT["message_id"].strip("<>")]
    assert lookup["includeSpamTrash"] == ["true"]


@pytest.mark.parametrize("answers, raised, said", [
    # the send is refused and the draft is still there: nothing was sent
    ([(400, error_body(400, "Invalid To header", "invalidArgument")), (200, {"id": "r-7"})],
     gmail.Refused, "Invalid To header"),
    # a 403 rate limit is worth retrying
    ([(403, error_body(403, "User-rate limit exceeded", "userRateLimitExceeded"))],
     gmail.Unavailable, "Gmail rate limit: User-rate limit exceeded"),
])
def test_google_answers_are_turned_into_what_they_mean(answers, raised, said):
    http = mock(*answers)
    with pytest.raises(raised) as caught:
        gmail.send("tc_0123456789ab", {**DRAFT, "gmail_draft_id": "r-7"}, service=gmail_client(http))
    assert str(caught.value) == said
    assert len(http.request_sequence) == len(answers)
    # the engine retries what the backend says is unavailable and fails the call on a refusal
    assert tools.is_transient(caught.value) == (raised is gmail.Unavailable)


def test_a_refused_draft_lookup_is_refused_before_anything_is_made():
    http = mock((403, error_body(403, "Request had insufficient authentication scopes.", "insufficientPermissions")))
    with pytest.raises(gmail.Refused, match="insufficient authentication scopes"):
        gmail.prepare(DRAFT, service=gmail_client(http))
    assert len(http.request_sequence) == 1


def test_a_5xx_goes_through_for_the_engine_to_retry():
    http = mock((503, error_body(503, "Backend Error", "backendError")))
    with pytest.raises(google.HttpError) as caught:
        gmail.send("tc_0123456789ab", {**DRAFT, "gmail_draft_id": "r-7"}, service=gmail_client(http))
    assert google.status_of(caught.value) == 503 and tools.is_transient(caught.value)


def test_gmail_scopes_allow_the_drafts_and_the_message_id_search():
    assert set(google.SCOPES["gmail"]) == {"https://www.googleapis.com/auth/gmail.compose",
                                           "https://www.googleapis.com/auth/gmail.readonly"}


# -- the tool, end to end through a worker and the Google double ------------------------------

def test_send_email_on_gmail_checkpoint_resume_completed(worker, relay, google_api):
    mail = GmailDouble(google_api)
    call = make_call(callback_url=relay.url, parameters={
        "to": "john@example.com", "cc": ["ann@example.com"], "subject": "Meeting Tomorrow", "body": "At 3pm."})
    id_ = call.tool_call_id
    actions.confirm(id_)
    checkpoint = relay.wait_for(id_, "checkpoint")
    assert checkpoint["preview"] == {"to": "john@example.com", "cc": ["ann@example.com"],
                                     "subject": "Meeting Tomorrow", "body": "At 3pm."}
    prepared = wait_status(id_, "PREPARED")
    assert prepared.committed_at is None
    [(draft_id, draft)] = mail.drafts.items()
    assert prepared.step_outputs["PREPARING"]["gmail_draft_id"] == draft_id, "the draft's id is recorded"
    assert mail.sent == [], "nothing is sent before the caller says send"

    actions.resume(id_)
    completed = relay.wait_for(id_, "completed")
    done = row(id_)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    [sent] = mail.sent
    assert done.result == {"message_id": sent["id"], "thread_id": sent["threadId"], "to": "john@example.com"}
    assert completed["result"] == done.result and done.voice_response == "Email sent to john@example.com."
    tools.TOOLS["send_email"].result_schema().load(done.result)  # the stated shape
    assert mail.drafts == {}, "the draft became the sent message"

    lookup, strays = google_api.requests_to("GET", r"/drafts$")  # at PREPARING, and once the draft is sent
    assert lookup.query["q"] == strays.query["q"] == [
        f"rfc822msgid:{id_}@{settings.load().deployment}.voice-tools.local"]
    assert lookup.headers["authorization"] == "Bearer test-access-token"
    [send] = google_api.requests_to("POST", r"/drafts/send$")
    assert send.json == {"id": draft_id}
    message = mime_of(sent["raw"])
    assert (message["To"], message["Cc"], message["Subject"]) == ("john@example.com", "ann@example.com",
                                                                  "Meeting Tomorrow")
    assert message["Message-ID"] == local_email.message_id_for(id_) and text_of(message) == "At 3pm."
    assert outbox_count() == 0, "Gmail, not the local outbox"


@pytest.mark.slow
def test_a_503_whose_send_went_through_is_found_on_retry_and_not_sent_twice(worker, relay, google_api):
    # The first send answers 503 although Gmail did send it: the retry finds the draft gone.
    mail = GmailDouble(google_api)
    mail.after["send"] = [(503, 0.0)]
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    done = wait_status(call.tool_call_id, timeout=30)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    [sent] = mail.sent
    assert done.result == {"message_id": sent["id"], "thread_id": sent["threadId"], "to": "john@example.com"}
    assert len(google_api.requests_to("POST", r"/drafts/send$")) == 2, "sent, then the retry found the draft gone"
    assert len(google_api.requests_to("GET", r"/messages$")) == 1, "and the message in the mailbox"
    relay.wait_for(call.tool_call_id, "completed")  # posted after the row is written
    assert [e["event"] for e in relay.events_for(call.tool_call_id)].count("completed") == 1


def test_a_refused_send_fails_the_call_saying_it_was_not_sent(worker, relay, google_api):
    mail = GmailDouble(google_api)
    mail.refuse["send"] = [400]
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed")
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and done.error_message == "Refused with 400"
    assert done.voice_response == "The email to john@example.com was not sent: Refused with 400."
    assert failed["voice_response"] == done.voice_response and failed["step"] == "SENDING"
    assert done.committed_at is not None, "it failed at the send itself, past the point of no return"
    assert len(google_api.requests_to("POST", r"/drafts/send$")) == 1, "a refusal is not retried"
    assert mail.sent == [] and len(mail.drafts) == 1, "the draft is still there: it was not sent"


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
        mail = GmailDouble(api)
        # Gmail sends the draft and then hangs: the link is held inside its side effect.
        mail.after["send"] = [(200, 30.0)]
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
            while not mail.sent:
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
            # SENDING completes the call itself: its "succeeded" line comes once the task returns
            deadline = time.monotonic() + 30
            while f"{SENDING_TASK}[{first['id']}] succeeded" not in (log := worker.log()) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
        assert done.status == "COMPLETED", (done.status, done.error_message)
        [sent] = mail.sent  # one email, although the link ran twice
        assert done.result == {"message_id": sent["id"], "thread_id": sent["threadId"], "to": "loss@example.com"}
        assert len(api.requests_to("POST", r"/drafts/send$")) == 2, "the second send found the draft gone"
        assert len(api.requests_to("GET", r"/messages$")) == 1
        assert done.attempts == 5, "SENDING claimed twice, every other step once"
        assert [h["status"] for h in done.status_history].count("COMPLETED") == 1
        assert "signal 9 (SIGKILL)" in log, log[-3000:]
        assert log.count(f"{SENDING_TASK}[{first['id']}] received") == 2, "the same message, delivered again"
        assert log.count(f"{SENDING_TASK}[{first['id']}] succeeded") == 1, log[-3000:]
