"""The calendar backend (voice_tools_backends/calendar.py) and the availability arithmetic, with a
database alone: the local table, the demo week, and Google Calendar through the real
google-api-python-client on ``HttpMockSequence`` (the requests it made are asserted on:
method, path, query and body)."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from urllib.parse import parse_qs, urlsplit
from zoneinfo import ZoneInfo

import pytest
from googleapiclient.errors import HttpError
from googleapiclient.http import HttpMockSequence
from sqlalchemy import select

from models import db
from models.calendar import CalendarEvent
from voice_tools_backends import calendar
from voice_tools_backends.google import build_service
from tasks.tools import TOOLS, PermanentError, StepInput
from tasks.tools.get_calendar_availability import free_slots, round_up, voice_response, window

UTC = timezone.utc
NY = ZoneInfo("America/New_York")


def at(day: int, hour: int, minute: int = 0, tz=UTC) -> datetime:
    """2026-11-<day> <hour>:<minute> (23 November 2026 is a Monday)."""
    return datetime(2026, 11, day, hour, minute, tzinfo=tz)


def meeting(tool_call_id: str = "tc_backend01", **over) -> dict:
    values = {"event_id": calendar.event_id_for(tool_call_id), "tool_call_id": tool_call_id,
              "title": "Project sync", "start": "2026-11-24T14:00:00-05:00", "end": "2026-11-24T14:30:00-05:00",
              "timezone": "America/New_York", "attendees": ["ann@example.com"], "description": "Agenda"}
    values.update(over)
    return values


def rows() -> list[CalendarEvent]:
    with db.session() as s:
        return list(s.scalars(select(CalendarEvent).order_by(CalendarEvent.starts_at)))


# -- ids -------------------------------------------------------------------------------------

def test_event_id_is_a_valid_google_id_fixed_by_the_call():
    first = calendar.event_id_for("call_ABC.123")
    assert first == calendar.event_id_for("call_ABC.123") != calendar.event_id_for("call_ABC.124")
    assert 5 <= len(first) <= 1024 and set(first) <= set("0123456789abcdefghijklmnopqrstuv")


# -- local ----------------------------------------------------------------------------------

def test_local_book_is_idempotent_and_shows_as_busy():
    first = calendar.book(meeting())
    again = calendar.book(meeting(title="Changed on redelivery"))  # a redelivered link: the stored event wins
    assert first == again == {
        "event_id": calendar.event_id_for("tc_backend01"), "start": "2026-11-24T14:00:00-05:00",
        "end": "2026-11-24T14:30:00-05:00",
        "html_link": None}  # the local calendar has no page to open: no link rather than one that 404s
    [stored] = rows()
    assert (stored.title, stored.tool_call_id, stored.attendees, stored.timezone) == (
        "Project sync", "tc_backend01", ["ann@example.com"], "America/New_York")
    assert stored.starts_at == at(24, 19) and stored.ends_at == at(24, 19, 30)

    assert calendar.busy(at(24, 0), at(25, 0)) == [
        {"start": at(24, 19), "end": at(24, 19, 30), "title": "Project sync"}]
    # overlap is strict: a window ending as the meeting starts, or starting as it ends, is free
    assert calendar.busy(at(24, 18, 30), at(24, 19)) == []
    assert calendar.busy(at(24, 19, 30), at(24, 20)) == []
    # clipped to the window
    assert calendar.busy(at(24, 19, 10), at(24, 19, 20))[0]["start"] == at(24, 19, 10)


def test_busy_periods_merge_when_they_overlap_or_touch():
    calendar.book(meeting("a", start="2026-11-24T10:00:00+00:00", end="2026-11-24T11:00:00+00:00", title="A"))
    calendar.book(meeting("b", start="2026-11-24T10:30:00+00:00", end="2026-11-24T12:00:00+00:00", title="B"))
    calendar.book(meeting("c", start="2026-11-24T12:00:00+00:00", end="2026-11-24T12:15:00+00:00", title="C"))
    calendar.book(meeting("d", start="2026-11-24T15:00:00+00:00", end="2026-11-24T16:00:00+00:00", title="D"))
    assert calendar.busy(at(24, 0), at(25, 0)) == [
        {"start": at(24, 10), "end": at(24, 12, 15), "title": "A"},
        {"start": at(24, 15), "end": at(24, 16), "title": "D"}]


def test_demo_week_is_this_iso_week_and_loads_once():
    added = calendar.load_demo()
    assert added == len(calendar.DEMO_WEEK) > 0
    assert calendar.load_demo() == 0
    stored = rows()
    assert len(stored) == added
    today = datetime.now(UTC).date()
    monday = today - timedelta(days=today.weekday())
    year, week, _ = monday.isocalendar()
    for event in stored:
        assert event.id.startswith(f"demo-{year}w{week:02d}-") and event.tool_call_id is None
        start = event.starts_at.astimezone(UTC)
        assert monday <= start.date() <= monday + timedelta(days=4)
        assert 9 <= start.hour and event.ends_at.astimezone(UTC).hour <= 17
    # another week's demo data has other ids
    assert {e["id"] for e in calendar.demo_events(monday + timedelta(days=7))}.isdisjoint({e.id for e in stored})


# -- the availability arithmetic --------------------------------------------------------------

def test_free_slots_are_working_hours_minus_busy_at_least_the_duration():
    busy = [(at(23, 9, 30), at(23, 9, 45)), (at(23, 10), at(23, 16, 40)), (at(24, 11), at(24, 12))]
    slots = free_slots(at(23, 0), at(28, 0), busy, 30, UTC)
    assert slots == [
        (at(23, 9), at(23, 9, 30)),  # 9:45-10:00 is shorter than 30 minutes, 16:40-17:00 too
        (at(24, 9), at(24, 11)), (at(24, 12), at(24, 17)),
        (at(25, 9), at(25, 17)), (at(26, 9), at(26, 17)), (at(27, 9), at(27, 17)),
    ]
    # the weekend has no working hours; a window inside a day clips it
    assert free_slots(at(28, 0), at(30, 0), [], 30, UTC) == []
    assert free_slots(at(25, 10, 15), at(25, 12), [], 30, UTC) == [(at(25, 10, 15), at(25, 12))]


def test_working_hours_are_in_the_windows_time_zone_across_a_dst_change():
    # New York leaves daylight saving time on Sunday 1 November 2026: Friday, Monday, Tuesday
    slots = free_slots(datetime(2026, 10, 30, tzinfo=NY), datetime(2026, 11, 4, tzinfo=NY), [], 60, NY)
    assert [(s.astimezone(NY).hour, e.astimezone(NY).hour) for s, e in slots] == [(9, 17)] * 3
    assert [s.astimezone(UTC).hour for s, _ in slots] == [13, 14, 14]


def test_window_defaults_and_rounding():
    now = datetime(2026, 11, 23, 10, 7, 30, tzinfo=UTC)
    assert round_up(now) == at(23, 10, 15) and round_up(at(23, 10)) == at(23, 10)
    start, end, tz = window({"timezone": "Europe/Paris"}, now=now)
    assert (start, end, str(tz)) == (at(23, 10, 15), at(30, 10, 15), "Europe/Paris")
    start, end, _ = window({"start": "2026-11-24T09:00:00", "timezone": "America/New_York"})
    assert (start, end) == (at(24, 14), at(24, 14) + timedelta(days=7))


def test_availability_sentences():
    planned = {"timezone": "UTC", "duration_minutes": 30}
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    far = today + timedelta(days=20)

    def iso(day: datetime, hour: int, minute: int = 0) -> str:
        return day.replace(hour=hour, minute=minute).isoformat()

    free = [{"start": iso(far, 14), "end": iso(far, 16)},
            {"start": iso(far + timedelta(days=1), 9, 30), "end": iso(far + timedelta(days=1), 12)},
            {"start": iso(far + timedelta(days=2), 11), "end": iso(far + timedelta(days=2), 13)},
            {"start": iso(far + timedelta(days=3), 9), "end": iso(far + timedelta(days=3), 17)}]
    said = voice_response({}, {"busy": [], "free": free, "window": planned})
    day = [calendar.full_day(far + timedelta(days=n)) for n in range(3)]
    assert said == (f"You're free {day[0]} from 2 to 4 p.m., {day[1]} from 9:30 a.m. to noon and "
                    f"{day[2]} from 11 a.m. to 1 p.m., plus 1 more free time.")
    assert voice_response({}, {"busy": [], "free": [{"start": iso(today + timedelta(days=1), 9),
                                                     "end": iso(today + timedelta(days=1), 10)}],
                               "window": planned}) == "You're free tomorrow from 9 to 10 a.m."
    none = voice_response({}, {"busy": [], "free": [], "window": {
        **planned, "duration_minutes": 45, "start": iso(far, 9), "end": iso(far + timedelta(days=1), 17, 30)}})
    assert none == (f"You have no free 45-minute slot in working hours between {day[0]} at 9 a.m. "
                    f"and {day[1]} at 5:30 p.m.")


# -- Google Calendar on HttpMockSequence -----------------------------------------------------

def google_calendar(answers: list[tuple[int, object]], calendar_name: str | None = None):
    http = HttpMockSequence([({"status": str(status)}, json.dumps(body)) for status, body in answers])
    return calendar.GoogleCalendar(build_service("calendar", "v3", http=http), calendar_name), http


def requests_made(http: HttpMockSequence) -> list[tuple[str, str, dict, object]]:
    """(method, path, query, JSON body) of every request the client made."""
    made = []
    for uri, method, body, _headers in http.request_sequence:
        parts = urlsplit(uri)
        made.append((method, parts.path, parse_qs(parts.query), json.loads(body) if body else None))
    return made


def google_error(status: int, message: str, reason: str = "notFound") -> tuple[int, dict]:
    return status, {"error": {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}}


INSERTED = {"id": calendar.event_id_for("tc_backend01"), "status": "confirmed",
            "htmlLink": "https://www.google.com/calendar/event?eid=abc",
            "start": {"dateTime": "2026-11-24T19:00:00Z", "timeZone": "America/New_York"},
            "end": {"dateTime": "2026-11-24T19:30:00Z", "timeZone": "America/New_York"}}


def test_google_freebusy_request_and_answer(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CALENDAR_ID", "team@example.com")
    cal, http = google_calendar([(200, {"kind": "calendar#freeBusy", "calendars": {"team@example.com": {"busy": [
        {"start": "2026-11-24T14:00:00Z", "end": "2026-11-24T15:00:00Z"},
        {"start": "2026-11-24T16:00:00-05:00", "end": "2026-11-24T16:30:00-05:00"}]}}})])
    assert cal.busy(at(24, 0), at(25, 0)) == [{"start": at(24, 14), "end": at(24, 15), "title": None},
                                              {"start": at(24, 21), "end": at(24, 21, 30), "title": None}]
    [(method, path, query, body)] = requests_made(http)
    assert (method, path) == ("POST", "/calendar/v3/freeBusy")
    assert body == {"timeMin": "2026-11-24T00:00:00Z", "timeMax": "2026-11-25T00:00:00Z", "timeZone": "UTC",
                    "items": [{"id": "team@example.com"}]}


def test_google_freebusy_calendar_errors():
    cal, _ = google_calendar([(200, {"calendars": {"primary": {"busy": [], "errors": [
        {"domain": "global", "reason": "notFound"}]}}})])
    with pytest.raises(calendar.Refused, match="calendar primary was not found"):
        cal.busy(at(24, 0), at(25, 0))
    cal, _ = google_calendar([(200, {"calendars": {"primary": {"errors": [{"reason": "backendError"}]}}})])
    with pytest.raises(calendar.Unavailable):
        cal.busy(at(24, 0), at(25, 0))


def test_google_insert_request_with_fixed_id_and_invitations():
    cal, http = google_calendar([(200, INSERTED)], "primary")
    booked = cal.book(meeting())
    assert booked == {"event_id": calendar.event_id_for("tc_backend01"), "start": "2026-11-24T14:00:00-05:00",
                      "end": "2026-11-24T14:30:00-05:00", "html_link": "https://www.google.com/calendar/event?eid=abc"}
    [(method, path, query, body)] = requests_made(http)
    assert (method, path) == ("POST", "/calendar/v3/calendars/primary/events")
    assert query["sendUpdates"] == ["all"]
    assert body == {"id": calendar.event_id_for("tc_backend01"), "summary": "Project sync", "description": "Agenda",
                    "start": {"dateTime": "2026-11-24T14:00:00-05:00", "timeZone": "America/New_York"},
                    "end": {"dateTime": "2026-11-24T14:30:00-05:00", "timeZone": "America/New_York"},
                    "attendees": [{"email": "ann@example.com"}]}


def test_google_insert_without_attendees_sends_no_invitations():
    cal, http = google_calendar([(200, INSERTED)])
    cal.book(meeting(attendees=[], description=""))
    [(_, _, query, body)] = requests_made(http)
    assert "sendUpdates" not in query and "attendees" not in body and "description" not in body


def test_google_insert_409_already_exists_reads_the_event_back():
    # a redelivered BOOKING link: the first run's insert went through
    cal, http = google_calendar([google_error(409, "The requested identifier already exists.", "duplicate"),
                                 (200, INSERTED)])
    booked = cal.book(meeting())
    assert booked["event_id"] == calendar.event_id_for("tc_backend01")
    assert booked["html_link"] == "https://www.google.com/calendar/event?eid=abc"
    (m1, p1, _, b1), (m2, p2, _, b2) = requests_made(http)
    event_id = calendar.event_id_for("tc_backend01")
    assert (m1, p1, b1["id"]) == ("POST", "/calendar/v3/calendars/primary/events", event_id)
    assert (m2, p2, b2) == ("GET", f"/calendar/v3/calendars/primary/events/{event_id}", None)


@pytest.mark.parametrize("status, reason, raised", [
    (404, "notFound", calendar.Refused),
    (400, "invalid", calendar.Refused),
    (403, "forbidden", calendar.Refused),
    (403, "rateLimitExceeded", calendar.Unavailable),
])
def test_google_insert_refusals_carry_googles_message(status, reason, raised):
    # a refused insert is checked against the call's event id: 404, nothing was booked
    cal, http = google_calendar([google_error(status, f"Google says {reason}.", reason),
                                 google_error(404, "Not Found", "notFound")])
    with pytest.raises(raised, match=f"Google says {reason}" if raised is calendar.Refused else "rate limit"):
        cal.book(meeting())
    event_id = calendar.event_id_for("tc_backend01")
    checked = [(m, p) for m, p, _, _ in requests_made(http)]
    assert checked == [("POST", "/calendar/v3/calendars/primary/events")] + (
        [("GET", f"/calendar/v3/calendars/primary/events/{event_id}")] if raised is calendar.Refused else [])


def test_google_5xx_goes_through_for_the_engine_to_retry():
    from tasks.tools import is_transient

    cal, _ = google_calendar([google_error(503, "Backend Error", "backendError")])
    with pytest.raises(HttpError) as info:
        cal.book(meeting())
    assert is_transient(info.value)


# -- the tool steps turn the backend's answers into the engine's errors --------------------------

def test_schedule_steps_conflict_is_permanent_and_booking_is_idempotent():
    tool = TOOLS["schedule_meeting"]
    check, book = tool.steps[0].run, tool.steps[2].run
    calendar.book(meeting("other", title="Design review", start="2026-11-24T14:15:00-05:00",
                          end="2026-11-24T15:00:00-05:00"))
    step = StepInput("tc_steps", "sess", {"title": "Project sync", "start": "2026-11-24T14:00:00",
                                          "duration_minutes": 30, "timezone": "America/New_York", "attendees": []}, {})
    with pytest.raises(PermanentError, match="^you already have Design review then$"):
        check(step)
    free = StepInput("tc_steps", "sess", {**step.parameters, "start": "2026-11-24T13:00:00"}, {})
    planned = check(free)
    assert planned == {"event_id": calendar.event_id_for("tc_steps"), "title": "Project sync",
                       "start": "2026-11-24T13:00:00-05:00", "end": "2026-11-24T13:30:00-05:00",
                       "timezone": "America/New_York", "attendees": [], "description": ""}
    assert book(StepInput("tc_steps", "sess", free.parameters, {"CHECKING_AVAILABILITY": planned}))["event_id"] == \
        planned["event_id"]
    assert len(rows()) == 2
