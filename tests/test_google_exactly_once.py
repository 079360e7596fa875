"""The Google backends act once per call, and say "unconfirmed" rather than "not sent" when unsure.

docs/operations.md, "Real backends": Gmail sends a draft recorded before the checkpoint
(``drafts.send`` cannot send one draft twice); Google Tasks and Gmail look for what an earlier
attempt may have made for ``VOICE_TOOLS_GOOGLE_CONFIRM_WAIT`` seconds before concluding;
Calendar inserts with an event id fixed by the call. Everything runs through the real
google-api-python-client against the stateful doubles of ``tests/google_fixtures.py``: a sent
draft is gone, a search may lag, a 503 may come after the service acted.
"""
from __future__ import annotations

import threading
import time

import pytest

from voice_tools_backends import Unconfirmed, calendar, email as local_email, gmail, google, task_list
from models import settings
from tasks import tools
from tasks.calls import actions
from tasks.tools import StepInput
from tests.google_fixtures import CalendarDouble, GmailDouble, TasksDouble
from tests.helpers import make_call, wait_status

EMAIL = {"to": "john@example.com", "subject": "Q3 numbers", "body": "Hi John, the numbers are in."}
TASK = {"title": "Call the printer", "notes": "Ask about the proofs.", "due": "2026-11-27", "priority": "high"}


@pytest.fixture
def quick_confirm(monkeypatch):
    """Look for an earlier attempt's effect for 4 s at most (the default is 10)."""
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CONFIRM_WAIT", "4")
    google.reset()
    yield
    google.reset()


def step_input(tool: str, tool_call_id: str, parameters: dict, outputs: dict, earlier_attempt: bool = False):
    return StepInput(tool_call_id, "sess_google", parameters, outputs, "tests", earlier_attempt=earlier_attempt)


def run_step(tool: str, name: str, given: StepInput):
    step = next(s for s in tools.TOOLS[tool].steps if s.name == name)
    return step.run(given)


def prepared_email(tool_call_id: str) -> dict:
    """send_email's PREPARING output on Gmail (the draft made and its id recorded)."""
    return run_step("send_email", "PREPARING", step_input("send_email", tool_call_id, EMAIL, {}))


def send_email(tool_call_id: str, prepared: dict, earlier_attempt: bool = False) -> dict:
    return run_step("send_email", "SENDING", step_input("send_email", tool_call_id, EMAIL, {"PREPARING": prepared},
                                                        earlier_attempt))


def in_threads(work, copies: int = 2) -> list:
    """Run ``work()`` in ``copies`` threads at once; their results (or what they raised)."""
    results: list = [None] * copies
    start = threading.Barrier(copies)

    def one(i: int) -> None:
        start.wait()
        try:
            results[i] = work()
        except Exception as exc:  # noqa: BLE001  (returned for the test to look at)
            results[i] = exc
        finally:
            google.reset()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# -- the deployment's Message-ID ---------------------------------------------------------------

def test_the_message_id_is_namespaced_by_the_deployment(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_DEPLOYMENT", "Acme EU")
    assert local_email.message_id_for("tc_1") == "<tc_1@acme-eu.voice-tools.local>"
    monkeypatch.setenv("VOICE_TOOLS_DEPLOYMENT", "globex")
    assert local_email.message_id_for("tc_1") == "<tc_1@globex.voice-tools.local>"
    monkeypatch.delenv("VOICE_TOOLS_DEPLOYMENT")
    default = settings.load().deployment
    assert default == settings.load().deployment and len(default) == 13 and default.startswith("d")
    other = settings.deployment_name("", "postgresql://u:p@db.other:5432/voice_tools")
    assert other != default, "another installation's database, another name"
    assert settings.deployment_name("", "postgresql://u:secret2@db.other:5432/voice_tools") == other, \
        "the password is not part of it"


# -- Gmail ---------------------------------------------------------------------------------------

def test_gmail_prepares_one_draft_and_a_redelivered_prepare_updates_it(google_api, quick_confirm):
    mail = GmailDouble(google_api)
    first = prepared_email("tc_gm_prepare")
    assert first["message_id"] == local_email.message_id_for("tc_gm_prepare")
    [(draft_id, draft)] = mail.drafts.items()
    assert first["gmail_draft_id"] == draft_id and draft["message_id"] == first["message_id"]
    again = prepared_email("tc_gm_prepare")
    assert again["gmail_draft_id"] == draft_id and len(mail.drafts) == 1, "found by its Message-ID, not made twice"
    assert mail.sent == [], "nothing is sent before the checkpoint"


def test_gmail_a_second_draft_made_by_a_lagging_look_up_is_deleted_once_the_call_is_sent(google_api,
                                                                                          quick_confirm):
    mail = GmailDouble(google_api, lag=0.5)
    prepared = prepared_email("tc_gm_strays")
    prepared_email("tc_gm_strays")  # another PREPARING copy: the first draft does not show yet
    assert len(mail.drafts) == 2
    time.sleep(0.6)
    send_email("tc_gm_strays", prepared)
    assert len(mail.sent) == 1 and mail.drafts == {}, "the stray draft is gone"


def test_gmail_send_sends_the_draft_and_a_second_send_finds_it_instead(google_api, quick_confirm):
    mail = GmailDouble(google_api)
    prepared = prepared_email("tc_gm_twice")
    sent = send_email("tc_gm_twice", prepared)
    assert sent == {"message_id": "gm-msg-2", "thread_id": "gm-thr-3", "to": "john@example.com"}
    assert send_email("tc_gm_twice", prepared) == sent, "the draft is gone: the sent message is found"
    assert len(mail.sent) == 1 and mail.drafts == {}


@pytest.mark.slow
def test_gmail_a_503_whose_send_went_through_and_a_lagging_search_send_once(google_api, quick_confirm):
    mail = GmailDouble(google_api, lag=2.0)
    mail.after["send"] = [(503, 0.0)]
    prepared = prepared_email("tc_gm_503")
    with pytest.raises(google.HttpError) as first:
        send_email("tc_gm_503", prepared)
    assert google.status_of(first.value) == 503 and tools.is_transient(first.value)
    began = time.monotonic()
    sent = send_email("tc_gm_503", prepared)  # the retry: the draft is gone, the search lags 2 s
    assert sent["message_id"] == mail.sent[0]["id"]
    assert 1.0 < time.monotonic() - began < 4.0, "it kept looking until the message showed"
    assert len(mail.sent) == 1, "one email"


@pytest.mark.slow
def test_gmail_a_search_lagging_past_the_bound_is_unconfirmed_never_a_second_send(google_api, quick_confirm):
    mail = GmailDouble(google_api, lag=60.0)
    mail.after["send"] = [(503, 0.0)]
    prepared = prepared_email("tc_gm_lag")
    with pytest.raises(google.HttpError):
        send_email("tc_gm_lag", prepared)
    began = time.monotonic()
    with pytest.raises(Unconfirmed):
        send_email("tc_gm_lag", prepared)
    assert 3.5 < time.monotonic() - began < 8, "looked for the configured 4 s"
    assert len(mail.sent) == 1
    assert len(google_api.requests_to("GET", r"/messages$")) >= 3, "re-queried with backoff"


@pytest.mark.slow
def test_gmail_an_earlier_attempt_then_a_refusal_is_unconfirmed_not_not_sent(google_api, quick_confirm):
    mail = GmailDouble(google_api, lag=60.0)
    prepared = prepared_email("tc_gm_earlier")
    send_email("tc_gm_earlier", prepared)  # the earlier attempt, whose answer was lost
    mail.refuse["send"] = [403]
    with pytest.raises(Unconfirmed):
        send_email("tc_gm_earlier", prepared, earlier_attempt=True)
    assert len(mail.sent) == 1


def test_gmail_an_earlier_attempt_then_a_refusal_finds_the_message_it_sent(google_api, quick_confirm):
    mail = GmailDouble(google_api)
    prepared = prepared_email("tc_gm_found")
    sent = send_email("tc_gm_found", prepared)
    mail.refuse["send"] = [403]
    assert send_email("tc_gm_found", prepared, earlier_attempt=True) == sent
    assert len(mail.sent) == 1


def test_gmail_an_earlier_attempt_that_did_not_send_sends_now(google_api, quick_confirm):
    mail = GmailDouble(google_api)
    prepared = prepared_email("tc_gm_notyet")
    sent = send_email("tc_gm_notyet", prepared, earlier_attempt=True)
    assert len(mail.sent) == 1 and sent["message_id"] == mail.sent[0]["id"]


def test_gmail_a_refusal_with_the_draft_still_there_is_not_sent(google_api, quick_confirm):
    mail = GmailDouble(google_api)
    prepared = prepared_email("tc_gm_refused")
    mail.refuse["send"] = [400]
    with pytest.raises(gmail.Refused, match="Refused with 400"):
        send_email("tc_gm_refused", prepared)
    assert mail.sent == [] and len(mail.drafts) == 1, "the draft is still there: nothing was sent"


@pytest.mark.slow
def test_gmail_two_sends_of_one_call_at_once_send_one_email(google_api, quick_confirm):
    mail = GmailDouble(google_api, lag=1.0)
    prepared = prepared_email("tc_gm_race")
    results = in_threads(lambda: send_email("tc_gm_race", prepared))
    assert len(mail.sent) == 1, "one email"
    assert results[0] == results[1] and results[0]["message_id"] == mail.sent[0]["id"], results


@pytest.mark.slow
def test_send_email_on_gmail_after_a_503_whose_send_went_through_sends_once(worker, relay, google_api,
                                                                              quick_confirm):
    """End to end: the retry of SENDING (1 s later) meets a search that lags 2 s."""
    mail = GmailDouble(google_api, lag=2.0)
    mail.after["send"] = [(503, 0.0)]
    call = make_call(callback_url=relay.url, parameters=dict(EMAIL))
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    done = wait_status(call.tool_call_id, timeout=30)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    assert len(mail.sent) == 1, "one email"
    assert done.result == {"message_id": mail.sent[0]["id"], "thread_id": mail.sent[0]["threadId"],
                           "to": "john@example.com"}
    assert mail.message_id_of(mail.sent[0]["raw"]) == local_email.message_id_for(call.tool_call_id)


@pytest.mark.slow
def test_send_email_on_gmail_a_503_then_refusals_says_unconfirmed_not_not_sent(worker, relay, google_api,
                                                                                monkeypatch):
    """The send went through but answered 503; the retry's answers are refusals (403): the call
    cannot say "not sent", and no second email goes out."""
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CONFIRM_WAIT", "1")
    mail = GmailDouble(google_api)
    mail.after["send"] = [(503, 0.0)]
    mail.refuse["search"] = [403] * 50
    call = make_call(callback_url=relay.url, parameters=dict(EMAIL))
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    mail.refuse["send"] = [None, 403]  # the first send goes through (then 503), the retry's is refused
    actions.resume(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed")
    done = wait_status(call.tool_call_id, timeout=30)
    assert done.status == "FAILED"
    said = tools.TOOLS["send_email"].say(tools.TOOLS["send_email"].unconfirmed_response, EMAIL)
    assert done.voice_response == said == failed["voice_response"]
    assert "not sent" not in done.voice_response
    assert len(mail.sent) == 1, "one email"


# -- Google Tasks --------------------------------------------------------------------------------

def create_task(tool_call_id: str, earlier_attempt: bool = False) -> dict:
    return run_step("create_task", "CREATING", step_input("create_task", tool_call_id, TASK, {"PREPARING": TASK},
                                                          earlier_attempt))


@pytest.mark.slow
def test_tasks_a_503_whose_insert_went_through_and_a_lagging_list_insert_once(google_api, quick_confirm):
    board = TasksDouble(google_api, lag=2.0)
    board.after["insert"] = [(503, 0.0)]
    made = create_task("tc_task_503")
    assert len(board.tasks) == 1 and made["task_id"] == board.tasks[0]["id"]
    assert create_task("tc_task_503") == made, "a retry finds it"
    assert len(board.tasks) == 1


@pytest.mark.slow
def test_tasks_a_503_then_a_list_that_refuses_is_unconfirmed_not_a_retry_told_not_created(google_api,
                                                                                          quick_confirm):
    board = TasksDouble(google_api)
    board.after["insert"] = [(503, 0.0)]
    board.refuse["list"] = [None] + [403] * 50  # the first look answers; after the insert, none does
    with pytest.raises(Unconfirmed):
        create_task("tc_task_503_403")
    assert len(board.tasks) == 1


@pytest.mark.slow
def test_tasks_an_earlier_attempt_finds_its_task_in_a_lagging_list(google_api, quick_confirm):
    board = TasksDouble(google_api, lag=2.0)
    made = create_task("tc_task_earlier")
    assert create_task("tc_task_earlier", earlier_attempt=True) == made
    assert len(board.tasks) == 1


@pytest.mark.slow
def test_tasks_an_earlier_attempt_not_found_in_time_is_unconfirmed_not_a_second_insert(google_api, quick_confirm):
    board = TasksDouble(google_api, lag=60.0)
    create_task("tc_task_unsure")
    with pytest.raises(Unconfirmed):
        create_task("tc_task_unsure", earlier_attempt=True)
    assert len(board.tasks) == 1


@pytest.mark.slow
def test_tasks_an_earlier_attempt_and_a_refused_list_is_unconfirmed(google_api, quick_confirm):
    board = TasksDouble(google_api)
    board.refuse["list"] = [403] * 20
    with pytest.raises(Unconfirmed):
        create_task("tc_task_refused", earlier_attempt=True)
    assert board.tasks == []


def test_tasks_two_creates_of_one_call_at_once_add_one_task(google_api, quick_confirm):
    board = TasksDouble(google_api, lag=1.0)
    board.after["insert"] = [(503, 0.5)]  # the first insert's answer is lost; the other copy is not told
    results = in_threads(lambda: create_task("tc_task_race"))
    assert len(board.tasks) == 1, results
    assert all(r == results[0] for r in results), results


@pytest.mark.slow
def test_create_task_on_google_after_a_503_whose_insert_went_through_adds_one(client, worker, google_api,
                                                                               quick_confirm):
    board = TasksDouble(google_api, lag=2.0)
    board.after["insert"] = [(503, 0.0)]
    call = make_call("create_task", dict(TASK), session_id="sess_google")
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id, timeout=30)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    assert len(board.tasks) == 1 and done.result["task_id"] == board.tasks[0]["id"]


@pytest.mark.slow
def test_create_task_on_google_a_503_and_a_list_lagging_past_the_wait_adds_one_and_says_unconfirmed(
        worker, relay, google_api, quick_confirm):
    """The list answers, without the task, for far longer than the confirm wait: that is no proof the
    insert did nothing, so the call ends unconfirmed and never inserts a second task."""
    board = TasksDouble(google_api, lag=60.0)
    board.after["insert"] = [(503, 0.0)]
    call = make_call("create_task", dict(TASK), callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=60)
    done = wait_status(call.tool_call_id, timeout=60)
    assert len(board.tasks) == 1, "one task"
    assert len(google_api.requests_to("POST", TasksDouble.PATH)) == 1, "one insert"
    assert done.status == "FAILED" and done.outcome == failed["outcome"] == "unconfirmed"
    said = tools.TOOLS["create_task"].say(tools.TOOLS["create_task"].unconfirmed_response, TASK)
    assert done.voice_response == said == failed["voice_response"]


# -- Google Calendar -----------------------------------------------------------------------------

MEETING_PARAMS = {"title": "Project sync", "start": "2030-11-26T14:00:00", "duration_minutes": 30,
                  "attendees": ["maria@example.com"], "timezone": "UTC", "description": ""}


def meeting_of(tool_call_id: str) -> dict:
    return {"event_id": calendar.event_id_for(tool_call_id), "title": "Project sync",
            "start": "2030-11-26T14:00:00+00:00", "end": "2030-11-26T14:30:00+00:00", "timezone": "UTC",
            "attendees": ["maria@example.com"], "description": ""}


def book(tool_call_id: str, earlier_attempt: bool = False) -> dict:
    outputs = {"CHECKING_AVAILABILITY": meeting_of(tool_call_id)}
    return run_step("schedule_meeting", "BOOKING",
                    step_input("schedule_meeting", tool_call_id, MEETING_PARAMS, outputs, earlier_attempt))


def test_calendar_a_503_whose_insert_went_through_books_once(google_api, quick_confirm):
    cal = CalendarDouble(google_api)
    cal.after["insert"] = [(503, 0.0)]
    with pytest.raises(google.HttpError):
        book("tc_cal_503")
    booked = book("tc_cal_503")  # the retry: 409, read back
    assert list(cal.events) == [booked["event_id"]] == [calendar.event_id_for("tc_cal_503")]


def test_calendar_a_503_that_booked_then_a_refused_retry_reads_the_event_not_not_booked(google_api, quick_confirm):
    cal = CalendarDouble(google_api)
    cal.after["insert"] = [(503, 0.0)]
    with pytest.raises(google.HttpError):
        book("tc_cal_503_403")
    cal.refuse["insert"] = [403]
    booked = book("tc_cal_503_403")  # the retry is refused; the calendar has the event the first made
    assert list(cal.events) == [booked["event_id"]]


def test_calendar_an_earlier_attempt_then_a_refusal_reads_the_event_it_booked(google_api, quick_confirm):
    cal = CalendarDouble(google_api)
    booked = book("tc_cal_found")
    cal.refuse["insert"] = [403]
    assert book("tc_cal_found", earlier_attempt=True) == booked
    assert len(cal.events) == 1


def test_calendar_an_earlier_attempt_then_a_refusal_with_no_answer_is_unconfirmed(google_api, quick_confirm):
    cal = CalendarDouble(google_api)
    cal.refuse["insert"] = [403]
    cal.refuse["get"] = [403]
    with pytest.raises(Unconfirmed):
        book("tc_cal_unsure", earlier_attempt=True)


def test_calendar_a_refusal_with_the_event_surely_absent_is_not_booked(google_api, quick_confirm):
    cal = CalendarDouble(google_api)
    cal.refuse["insert"] = [403]
    with pytest.raises(calendar.Refused):
        book("tc_cal_refused", earlier_attempt=True)  # events.get says 404: nothing was booked
    assert cal.events == {}


def test_calendar_two_bookings_of_one_call_at_once_make_one_event(google_api, quick_confirm):
    cal = CalendarDouble(google_api)
    results = in_threads(lambda: book("tc_cal_race"))
    assert len(cal.events) == 1 and results[0] == results[1], results
