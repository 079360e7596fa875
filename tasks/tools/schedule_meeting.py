"""schedule_meeting: write; checks the slot is free, stops to ask, then books it once.

Steps (gate names): CHECKING_AVAILABILITY (free/busy over the slot; a conflict fails
the call before the point of no return) → READY_TO_BOOK (checkpoint; preview: title,
start, end, attendees, timezone) → BOOKING (the side effect: the event id is derived
from the tool_call_id, so a redelivered link finds the event it booked) → COMPLETED.

``start`` is ISO 8601; a time without an offset is read in ``timezone``.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from marshmallow import Schema, ValidationError, fields, validate, validates_schema

from voice_tools_backends import calendar
from tasks.tools import PermanentError, Step, StepInput, Tool
from tasks.tools._fields import valid_datetime, valid_timezone

# a start this far in the past is still accepted (a caller saying "now", a slow confirmation)
PAST_GRACE = timedelta(minutes=10)


def valid_start(text: str) -> None:
    valid_datetime(text)
    if "T" not in text.upper() and " " not in text.strip():
        raise ValidationError("Give a time as well as a date, such as 2026-11-24T14:00:00.")


class ScheduleMeetingParameters(Schema):
    title = fields.String(required=True, validate=validate.Length(min=1, max=300),
                          metadata={"description": "What the meeting is called"})
    start = fields.String(required=True, validate=[validate.Length(max=64), valid_start],
                          metadata={"description": "When it starts, ISO 8601 (2026-11-24T14:00:00); "
                                                   "a time without an offset is read in timezone"})
    duration_minutes = fields.Integer(load_default=30, validate=validate.Range(min=5, max=480),
                                      metadata={"description": "How long it lasts, in minutes (5 to 480)"})
    attendees = fields.List(fields.Email(), load_default=list, validate=validate.Length(max=50),
                            metadata={"description": "Email addresses of the people to invite"})
    timezone = fields.String(load_default="UTC", validate=[validate.Length(min=1, max=64), valid_timezone],
                             metadata={"description": "IANA time zone of the meeting (Europe/London); default UTC"})
    description = fields.String(load_default="", validate=validate.Length(max=8000),
                                metadata={"description": "Agenda or notes for the invitation"})

    @validates_schema
    def _not_in_the_past(self, data: dict[str, Any], **_: Any) -> None:
        start = calendar.parse_datetime(data["start"], calendar.zone(data.get("timezone") or "UTC"))
        if start < datetime.now(timezone.utc) - PAST_GRACE:
            raise ValidationError("That time has already passed.", field_name="start")


# -- what the steps do ------------------------------------------------------------------------

def slot(parameters: Mapping[str, Any]) -> tuple[datetime, datetime, Any]:
    """The meeting's start and end, aware, in its time zone."""
    tz = calendar.zone(parameters.get("timezone") or "UTC")
    start = calendar.parse_datetime(parameters["start"], tz).astimezone(tz)
    return start, start + timedelta(minutes=int(parameters.get("duration_minutes") or 30)), tz


def check_availability(step: StepInput) -> dict[str, Any]:
    p = step.parameters
    start, end, tz = slot(p)
    taken = calendar.busy(start, end, step.caller)  # the caller's own meetings only: its sentence names one
    if taken:
        first = taken[0]
        if first["title"]:
            raise PermanentError(f"you already have {first['title']} then")
        s, e = first["start"].astimezone(tz), first["end"].astimezone(tz)
        raise PermanentError(f"from {calendar.clock(s)} to {calendar.clock(e)} your calendar is already busy")
    return {
        "event_id": calendar.event_id_for(step.tool_call_id),
        "title": p["title"],
        "start": start.isoformat(),
        "end": end.isoformat(),
        "timezone": str(tz),
        "attendees": list(p.get("attendees") or []),
        "description": p.get("description") or "",
    }


def preview(step: StepInput) -> dict[str, Any]:
    meeting = step.outputs["CHECKING_AVAILABILITY"]
    return {key: meeting[key] for key in ("title", "start", "end", "attendees", "timezone")}


def book(step: StepInput) -> dict[str, Any]:
    meeting = {**step.outputs["CHECKING_AVAILABILITY"], "tool_call_id": step.tool_call_id}
    return calendar.book(meeting, step.caller, earlier_attempt=step.earlier_attempt)


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    booked = outputs["BOOKING"]
    return {key: booked[key] for key in ("event_id", "start", "end", "html_link")}


class ScheduleMeetingResult(Schema):
    event_id = fields.String(required=True, metadata={"description": "The calendar event's id"})
    start = fields.String(required=True, metadata={"description": "ISO 8601, in the meeting's time zone"})
    end = fields.String(required=True, metadata={"description": "ISO 8601, in the meeting's time zone"})
    html_link = fields.String(required=True, allow_none=True,
                              metadata={"description": "Where to open the event in Google Calendar (null on the "
                                                       "local calendar, which has no page to open)"})


# -- what is said -----------------------------------------------------------------------------

def _with(attendees: list[str]) -> str:
    if not attendees:
        return ""
    if len(attendees) == 1:
        return f" with {attendees[0]}"
    if len(attendees) == 2:
        return f" with {attendees[0]} and {attendees[1]}"
    return f" with {attendees[0]} and {len(attendees) - 1} others"


def meeting_phrase(parameters: Mapping[str, Any], start: datetime | None = None) -> str:
    """``Project sync on Tuesday, November 24 at 2 p.m. for 30 minutes with ann@example.com``."""
    title = parameters.get("title") or "the meeting"
    minutes = int(parameters.get("duration_minutes") or 30)
    try:
        when = start or slot(parameters)[0]
        said = f"{title} on {calendar.full_day(when)} at {calendar.clock(when)}"
    except (KeyError, TypeError, ValueError):  # unreadable parameters: say what we have
        said = f"{title} at {parameters.get('start') or 'the time given'}"
    return f"{said} for {calendar.spoken_duration(minutes)}{_with(list(parameters.get('attendees') or []))}"


def confirmation_message(parameters: Mapping[str, Any], **_: Any) -> str:
    return f"Ready to book {meeting_phrase(parameters)}. Confirm to proceed."


def modified_message(parameters: Mapping[str, Any], **_: Any) -> str:
    return f"Updated: {meeting_phrase(parameters)}. Confirm?"


def ready_message(parameters: Mapping[str, Any], **_: Any) -> str:
    return f"The time is free: {meeting_phrase(parameters)}. Book it?"


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    start = None
    if result and result.get("start"):
        try:
            start = calendar.parse_datetime(result["start"]).astimezone(slot(parameters)[2])
        except (KeyError, ValueError):
            start = None
    return f"Booked {meeting_phrase(parameters, start)}."


EXAMPLE_TIMEZONE = "America/New_York"


def _example_start() -> str:
    """Tuesday of next week at 2 PM (the demo data fills only the current week)."""
    today = datetime.now(calendar.zone(EXAMPLE_TIMEZONE)).date()
    tuesday = today - timedelta(days=today.weekday()) + timedelta(days=8)
    return f"{tuesday.isoformat()}T14:00:00"


TOOL = Tool(
    name="schedule_meeting",
    description="Book a meeting in the caller's calendar: check the time is free, let the caller confirm, "
                "then create the event and invite the attendees.",
    schema=ScheduleMeetingParameters,
    action_level="write",
    steps=(
        Step("CHECKING_AVAILABILITY", run=check_availability, message="Checking your calendar for {title}."),
        Step("READY_TO_BOOK", checkpoint=True, preview=preview, message=ready_message),
        Step("BOOKING", run=book, side_effect=True, message="Booking {title}."),
        Step("COMPLETED", message="Booked {title}."),
    ),
    result=result,
    result_schema=ScheduleMeetingResult,
    confirmation_message=confirmation_message,
    start_message="Checking your calendar for {title}.",
    modified_message=modified_message,
    voice_response=voice_response,
    failure_response="The meeting {title} was not booked: {error}.",
    cancelled_response="Cancelled. The meeting was not booked.",
    unconfirmed_response="I could not confirm that {title} was booked. Please check your calendar before trying again.",
    after_effect_failure_response="{title} was booked, but a later step failed: {error}.",
    time_limit=60,
    example={
        "title": "Project sync",
        "start": _example_start(),
        "duration_minutes": 30,
        "attendees": ["maria@example.com"],
        "timezone": EXAMPLE_TIMEZONE,
        "description": "Weekly check-in on the Q3 rollout.",
    },
)
