"""schedule_meeting and get_calendar_availability end to end: the API, a real worker, the
relay's callbacks and the rows, on the local calendar and on Google Calendar (the
``google_api`` HTTP double, reached by the real client library); and a BOOKING link
whose prefork child is SIGKILLed mid-insert, redelivered, booking once."""
from __future__ import annotations

import time
from datetime import date, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import select

from models import db
from models.calendar import CalendarEvent
from tasks import app, tools
from tasks.calls import actions
from voice_tools_backends import calendar
from tests.api_fixtures import call_count, snapshot
from tests.conftest import AUTH
from tests.google_fixtures import google_env
from tests.helpers import deliveries, make_call, row, wait_status
from tests.http_double import HttpDouble
from support.worker_process import WorkerProcess, queues_taken_from_others

UTC = timezone.utc
NY = ZoneInfo("America/New_York")
SCHEDULE = tools.TOOLS["schedule_meeting"]
AVAILABILITY = tools.TOOLS["get_calendar_availability"]


def next_week(weekday: int, tz=UTC) -> date:
    """The date of ``weekday`` (0 = Monday) in next week."""
    today = datetime.now(tz).date()
    return today - timedelta(days=today.weekday()) + timedelta(days=7 + weekday)


def at(day: date, hour: int, minute: int = 0, tz=UTC) -> datetime:
    return datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz)


TUESDAY = next_week(1, NY)
MEETING = {"title": "Project sync", "start": f"{TUESDAY.isoformat()}T14:00:00", "duration_minutes": 45,
           "attendees": ["ann@example.com"], "timezone": "America/New_York", "description": "Rollout status"}
WHEN = f"{calendar.full_day(TUESDAY)} at 2 p.m."


def events_in_table() -> list[CalendarEvent]:
    with db.session() as s:
        return list(s.scalars(select(CalendarEvent).order_by(CalendarEvent.starts_at)))


def execute(client, function: str, parameters: dict, **extra):
    """POST /voice-tools/execute?wait=15 (the relay already confirmed it)."""
    return client.post("/voice-tools/execute?wait=15", headers=AUTH, json={
        "session_id": "sess_cal", "function": function, "parameters": parameters, **extra})


def book_through_the_api(client, parameters: dict) -> dict:
    started = execute(client, "schedule_meeting", parameters)
    assert started.status_code == 200 and started.get_json()["status"] == "PREPARED", started.get_json()
    done = client.post(f"/voice-tools/resume/{started.get_json()['tool_call_id']}?wait=15", headers=AUTH,
                       json={"action": "proceed"})
    assert done.status_code == 200 and done.get_json()["status"] == "COMPLETED", done.get_json()
    return done.get_json()


# -- schedule_meeting on the local calendar --------------------------------------------------------

def test_schedule_meeting_checkpoint_then_books(client, worker, relay):
    recorded = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_cal", "function": "schedule_meeting", "parameters": MEETING, "callback_url": relay.url})
    assert recorded.status_code == 201, recorded.get_json()
    body = recorded.get_json()
    assert body["message"] == f"Ready to book Project sync on {WHEN} for 45 minutes with ann@example.com. " \
                              "Confirm to proceed."
    tool_call_id = body["tool_call_id"]

    prepared = client.post(f"/voice-tools/confirm/{tool_call_id}?wait=15", headers=AUTH)
    assert prepared.status_code == 200, prepared.get_json()
    assert (prepared.get_json()["status"], prepared.get_json()["current_step"]) == ("PREPARED", "READY_TO_BOOK")
    start, end = at(TUESDAY, 14, tz=NY), at(TUESDAY, 14, 45, tz=NY)
    checkpoint = relay.wait_for(tool_call_id, "checkpoint")
    assert (checkpoint["step"], checkpoint["gate"], checkpoint["requires_confirmation"]) == ("READY_TO_BOOK", 2, True)
    assert checkpoint["preview"] == {"title": "Project sync", "start": start.isoformat(), "end": end.isoformat(),
                                     "attendees": ["ann@example.com"], "timezone": "America/New_York"}
    assert checkpoint["message"] == f"The time is free: Project sync on {WHEN} for 45 minutes with ann@example.com. " \
                                    "Book it?"
    assert events_in_table() == [] and row(tool_call_id).committed_at is None

    done = client.post(f"/voice-tools/resume/{tool_call_id}?wait=15", headers=AUTH, json={"action": "proceed"})
    assert done.status_code == 200, done.get_json()
    body = done.get_json()
    assert body["status"] == "COMPLETED", body
    event_id = calendar.event_id_for(tool_call_id)
    assert body["result"] == {"event_id": event_id, "start": start.isoformat(), "end": end.isoformat(),
                              "html_link": None}  # the local calendar has no page to open (no link that 404s)
    assert SCHEDULE.result_schema().validate(body["result"]) == {}
    assert body["voice_response"] == f"Booked Project sync on {WHEN} for 45 minutes with ann@example.com."
    [event] = events_in_table()
    assert (event.id, event.tool_call_id, event.title, event.attendees, event.description) == (
        event_id, tool_call_id, "Project sync", ["ann@example.com"], "Rollout status")
    assert (event.starts_at, event.ends_at) == (start, end)

    relay.wait_for(tool_call_id, "completed")
    assert [(e["event"], e["step"], e["cancellable"]) for e in relay.events_for(tool_call_id)] == [
        ("progress", "CHECKING_AVAILABILITY", True), ("checkpoint", "READY_TO_BOOK", True),
        ("progress", "BOOKING", False), ("completed", "COMPLETED", False)]
    assert relay.events_for(tool_call_id)[-1]["voice_response"] == body["voice_response"]


def test_availability_sees_the_meeting_just_booked_as_busy(client, worker):
    wednesday = next_week(2)
    book_through_the_api(client, {"title": "Budget review", "start": f"{wednesday}T10:00:00Z",
                                  "duration_minutes": 60})
    answer = execute(client, "get_calendar_availability", {
        "start": f"{wednesday}T00:00:00", "end": f"{wednesday + timedelta(days=1)}T00:00:00"})
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    assert body["status"] == "COMPLETED", body
    iso = lambda h, m=0: at(wednesday, h, m).isoformat()  # noqa: E731
    assert body["result"]["busy"] == [{"start": iso(10), "end": iso(11)}]
    assert body["result"]["free"] == [{"start": iso(9), "end": iso(10)}, {"start": iso(11), "end": iso(17)}]
    assert body["result"]["window"] == {"start": iso(0), "end": at(wednesday + timedelta(days=1), 0).isoformat(),
                                        "timezone": "UTC", "duration_minutes": 30}
    assert AVAILABILITY.result_schema().validate(body["result"]) == {}
    ahead = (wednesday - datetime.now(UTC).date()).days
    day = "Wednesday" if ahead < 7 else calendar.full_day(wednesday)
    assert body["voice_response"] == f"You're free {day} from 9 to 10 a.m. and {day} from 11 a.m. to 5 p.m."


def test_availability_with_no_free_slot_completes_saying_so(client, worker):
    saturday = next_week(5)
    answer = execute(client, "get_calendar_availability", {
        "start": f"{saturday}T08:00:00", "end": f"{saturday + timedelta(days=1)}T20:00:00",
        "duration_minutes": 60, "timezone": "Europe/London"})
    body = answer.get_json()
    assert answer.status_code == 200 and body["status"] == "COMPLETED", body
    assert body["result"]["free"] == [] and body["result"]["busy"] == []
    assert body["voice_response"].startswith("You have no free 60-minute slot in working hours between ")
    assert body["voice_response"].endswith(" at 8 p.m."), body["voice_response"]


def test_a_conflict_fails_before_the_point_of_no_return(worker, relay):
    calendar.book({"event_id": "other-meeting", "tool_call_id": None, "title": "Design review",
                   "start": at(TUESDAY, 14, 30, tz=NY).isoformat(), "end": at(TUESDAY, 15, 30, tz=NY).isoformat(),
                   "timezone": "America/New_York", "attendees": [], "description": ""})
    call = make_call("schedule_meeting", MEETING, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = wait_status(call.tool_call_id)
    assert failed.status == "FAILED", (failed.status, failed.error_message)
    assert failed.error_message == "you already have Design review then"
    assert failed.voice_response == "The meeting Project sync was not booked: you already have Design review then."
    assert failed.committed_at is None and failed.current_step == "CHECKING_AVAILABILITY"
    assert [e.id for e in events_in_table()] == ["other-meeting"]
    event = relay.wait_for(call.tool_call_id, "failed")
    assert event["voice_response"] == failed.voice_response and event["step"] == "CHECKING_AVAILABILITY"
    assert [d.event for d in deliveries(call.tool_call_id)] == ["failed"]


def test_cancel_at_the_checkpoint_books_nothing(client, worker):
    started = execute(client, "schedule_meeting", MEETING)
    assert started.get_json()["status"] == "PREPARED", started.get_json()
    cancelled = client.delete(f"/voice-tools/cancel/{started.get_json()['tool_call_id']}", headers=AUTH)
    assert cancelled.status_code == 200
    assert cancelled.get_json()["voice_response"] == "Cancelled. The meeting was not booked."
    assert events_in_table() == []


# -- 422: the bad field is named and nothing changes -----------------------------------------------

@pytest.mark.parametrize("function, parameters, field", [
    ("schedule_meeting", {**MEETING, "timezone": "Mars/Olympus_Mons"}, "timezone"),
    ("schedule_meeting", {**MEETING, "start": "next Tuesday at 2"}, "start"),
    ("schedule_meeting", {**MEETING, "start": TUESDAY.isoformat()}, "start"),  # a date without a time
    ("schedule_meeting", {**MEETING, "start": "2020-01-07T14:00:00"}, "start"),  # in the past
    ("schedule_meeting", {**MEETING, "duration_minutes": 600}, "duration_minutes"),
    ("schedule_meeting", {**MEETING, "attendees": ["not an address"]}, "attendees"),
    ("get_calendar_availability", {"start": "2030-01-08T09:00:00", "end": "2030-01-07T09:00:00"}, "end"),
    ("get_calendar_availability", {"start": "2030-01-08T09:00:00", "end": "2030-03-08T09:00:00"}, "end"),
    ("get_calendar_availability", {"timezone": "Europe/Londres"}, "timezone"),
    ("get_calendar_availability", {"start": "tomorrow"}, "start"),
])
def test_bad_parameters_are_422_naming_the_field(client, function, parameters, field):
    before = snapshot()
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_cal", "function": function, "parameters": parameters})
    assert answer.status_code == 422, answer.get_json()
    body = answer.get_json()
    assert body["error"] == "validation_error"
    assert list(body["details"]["fields"]["parameters"]) == [field], body
    assert snapshot() == before


def test_modify_to_a_bad_timezone_is_422_and_changes_nothing(client):
    recorded = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_cal", "function": "schedule_meeting", "parameters": MEETING})
    tool_call_id = recorded.get_json()["tool_call_id"]
    answer = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                          json={"parameters": {"timezone": "Not/AZone"}})
    assert answer.status_code == 422 and "timezone" in answer.get_json()["details"]["fields"]["parameters"]
    assert row(tool_call_id).parameters == SCHEDULE.schema().load(MEETING)
    moved = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                         json={"parameters": {"timezone": "Europe/London"}})
    assert moved.status_code == 200
    assert moved.get_json()["message"] == (f"Updated: Project sync on {WHEN} for 45 minutes with ann@example.com. "
                                           "Confirm?")
    assert call_count() == 1


# -- Google Calendar through the HTTP double ---------------------------------------------------------

FREE = {"kind": "calendar#freeBusy", "calendars": {"primary": {"busy": []}}}


def google_event(request) -> dict:
    """What Google answers to an insert: the event as sent, with its link."""
    sent = request.json
    return {**sent, "status": "confirmed", "htmlLink": f"https://www.google.com/calendar/event?eid={sent['id']}"}


def google_error(status: int, message: str, reason: str) -> dict:
    return {"error": {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}}


@pytest.mark.slow
def test_google_503_on_insert_is_retried_then_booked_once(google_api, worker, relay):
    google_api.answer("POST", r"/freeBusy$", FREE)
    google_api.answer("POST", r"/calendars/primary/events$", google_error(503, "Backend Error", "backendError"),
                      status=503)
    google_api.answer("POST", r"/calendars/primary/events$", google_event)
    call = make_call("schedule_meeting", MEETING, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    [freebusy] = google_api.requests_to("POST", r"/freeBusy$")
    start, end = at(TUESDAY, 14, tz=NY), at(TUESDAY, 14, 45, tz=NY)
    assert freebusy.json == {"timeMin": calendar.rfc3339(start), "timeMax": calendar.rfc3339(end), "timeZone": "UTC",
                             "items": [{"id": "primary"}]}
    assert freebusy.headers["authorization"] == "Bearer test-access-token"

    actions.resume(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    event_id = calendar.event_id_for(call.tool_call_id)
    assert done.result == {"event_id": event_id, "start": start.isoformat(), "end": end.isoformat(),
                           "html_link": f"https://www.google.com/calendar/event?eid={event_id}"}
    inserts = google_api.requests_to("POST", r"/calendars/primary/events$")
    assert [r.json["id"] for r in inserts] == [event_id, event_id]  # the retry books the same event
    assert inserts[1].query["sendUpdates"] == ["all"]
    assert inserts[1].json["attendees"] == [{"email": "ann@example.com"}]
    assert inserts[1].json["start"] == {"dateTime": start.isoformat(), "timeZone": "America/New_York"}
    assert events_in_table() == []  # Google, not the local table
    assert [d.event for d in deliveries(call.tool_call_id)].count("completed") == 1
    assert relay.wait_for(call.tool_call_id, "completed")["result"] == done.result


def test_google_404_on_insert_fails_saying_it_was_not_booked(google_api, worker, relay, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CALENDAR_ID", "gone@example.com")
    google_api.answer("POST", r"/freeBusy$", {"calendars": {"gone@example.com": {"busy": []}}})
    google_api.answer("POST", r"/calendars/gone(@|%40)example.com/events$", google_error(404, "Not Found", "notFound"),
                      status=404)
    google_api.answer("GET", r"/calendars/gone(@|%40)example.com/events/[^/]+$",
                      google_error(404, "Not Found", "notFound"), status=404)  # the event id is checked: not booked
    call = make_call("schedule_meeting", MEETING, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    wait_status(call.tool_call_id, "PREPARED")
    actions.resume(call.tool_call_id)
    failed = wait_status(call.tool_call_id)
    assert failed.status == "FAILED"
    assert failed.voice_response == "The meeting Project sync was not booked: Not Found."
    assert len(google_api.requests_to("POST", r"/events$")) == 1  # permanent: not retried
    assert relay.wait_for(call.tool_call_id, "failed")["voice_response"] == failed.voice_response


def test_google_availability_from_freebusy_after_a_rate_limit(google_api, worker):
    thursday = next_week(3)
    # Google's 403 rateLimitExceeded is worth retrying (the backend says Unavailable, the engine retries)
    google_api.answer("POST", r"/freeBusy$", google_error(403, "Rate Limit Exceeded", "rateLimitExceeded"), status=403)
    google_api.answer("POST", r"/freeBusy$", {"calendars": {"primary": {"busy": [
        {"start": f"{thursday}T09:00:00Z", "end": f"{thursday}T12:30:00Z"},
        {"start": f"{thursday}T12:00:00Z", "end": f"{thursday}T13:00:00Z"}]}}})
    call = make_call("get_calendar_availability", {"start": f"{thursday}T00:00:00Z",
                                                   "end": f"{thursday}T23:00:00Z", "duration_minutes": 120})
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED", done.error_message
    iso = lambda h, m=0: at(thursday, h, m).isoformat()  # noqa: E731
    assert done.result["busy"] == [{"start": iso(9), "end": iso(13)}]
    assert done.result["free"] == [{"start": iso(13), "end": iso(17)}]
    limited, freebusy = google_api.requests_to("POST", r"/freeBusy$")
    assert limited.json == freebusy.json
    assert (freebusy.json["timeMin"], freebusy.json["timeMax"]) == (f"{thursday}T00:00:00Z", f"{thursday}T23:00:00Z")
    assert done.voice_response.startswith("You're free ") and done.voice_response.endswith(" from 1 to 5 p.m.")


# -- a worker dies mid-booking --------------------------------------------------------------------

QUEUE = "tools.schedule_meeting"
BOOKING = "tools.schedule_meeting.BOOKING"
# CHECKING_AVAILABILITY, READY_TO_BOOK, BOOKING, COMPLETED: four claims; a redelivery adds one
CLAIMS_WITHOUT_LOSS = 4


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_booking_redelivered_after_its_child_is_killed_books_once(tmp_path, relay):
    """The first events.insert is held by the double (``delay``) while its pool child is
    SIGKILLed past the point of no return; the redelivered link inserts the same event
    id, Google answers 409 (the first insert went through) and the event is read back."""
    tool_call_id = "tc_cal_killed"
    event_id = calendar.event_id_for(tool_call_id)
    event = {"id": event_id, "status": "confirmed", "htmlLink": f"https://www.google.com/calendar/event?eid={event_id}",
             "start": {"dateTime": at(TUESDAY, 19).strftime("%Y-%m-%dT%H:%M:%SZ"), "timeZone": "America/New_York"},
             "end": {"dateTime": at(TUESDAY, 19, 45).strftime("%Y-%m-%dT%H:%M:%SZ"), "timeZone": "America/New_York"}}
    with HttpDouble() as api, queues_taken_from_others(app, [QUEUE]):
        api.answer("POST", r"/freeBusy$", FREE, times=None)
        api.answer("POST", r"/calendars/primary/events$", event, delay=30)  # held: the child dies waiting
        api.answer("POST", r"/calendars/primary/events$", google_error(409, "The requested identifier already "
                                                                            "exists.", "duplicate"), status=409)
        api.answer("GET", rf"/calendars/primary/events/{event_id}$", event)
        env = {**google_env(api, tmp_path, services="calendar"), "VOICE_TOOLS_GOOGLE_TIMEOUT": "60"}
        with WorkerProcess(app, [QUEUE], pool="prefork", concurrency=2, log_dir=tmp_path, name="cal-loss",
                           env=env) as worker:
            make_call("schedule_meeting", MEETING, tool_call_id=tool_call_id, callback_url=relay.url)
            actions.confirm(tool_call_id)
            wait_status(tool_call_id, "PREPARED", timeout=60)
            actions.resume(tool_call_id)
            running = worker.wait_active(BOOKING, [tool_call_id])
            wait_until(lambda: len(api.requests_to("POST", r"/events$")) == 1, "the first insert to reach Google")
            held = row(tool_call_id)
            assert (held.status, held.current_step) == ("EXECUTING", "BOOKING")
            assert held.committed_at is not None, "the link is past the point of no return"
            worker.kill_child(running["worker_pid"])

            done = wait_status(tool_call_id, timeout=60)
            assert done.status == "COMPLETED", (done.status, done.error_message, worker.log()[-3000:])
            assert "signal 9 (SIGKILL)" in worker.log()
            # the link posts `completed` right after its commit: wait for it before stopping its worker
            completed = relay.wait_for(tool_call_id, "completed", timeout=30)
        inserts = api.requests_to("POST", r"/calendars/primary/events$")
        assert [r.json["id"] for r in inserts] == [event_id, event_id], "the redelivered link booked the same id"
        assert len(api.requests_to("GET", rf"/events/{event_id}$")) == 1
    assert done.result == {"event_id": event_id, "start": at(TUESDAY, 14, tz=NY).isoformat(),
                           "end": at(TUESDAY, 14, 45, tz=NY).isoformat(), "html_link": event["htmlLink"]}
    assert done.attempts == CLAIMS_WITHOUT_LOSS + 1, "BOOKING claimed twice, everything else once"
    assert [d.event for d in deliveries(tool_call_id)] == ["progress", "checkpoint", "progress", "completed"]
    assert [e["status"] for e in done.status_history].count("COMPLETED") == 1
    assert completed["result"] == done.result
    assert done.voice_response == f"Booked Project sync on {WHEN} for 45 minutes with ann@example.com."
