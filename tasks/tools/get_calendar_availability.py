"""get_calendar_availability: read; the caller's busy times and free slots in a window.

Steps: PLANNING (the window: ``start`` default now, ``end`` default start + 7 days, at
most 31 days) → CHECKING_CALENDAR (the busy periods: local table or Google freebusy)
→ FINDING_FREE_TIME (working hours, 09:00-17:00 Monday to Friday in ``timezone``,
minus the busy periods, kept when at least ``duration_minutes`` long) → COMPLETED.
"""
from __future__ import annotations

from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Iterable, Mapping

from marshmallow import Schema, ValidationError, fields, validate, validates_schema

from voice_tools_backends import calendar
from tasks.tools import PermanentError, Step, StepInput, Tool
from tasks.tools._fields import valid_datetime, valid_timezone

DEFAULT_DAYS = 7
MAX_DAYS = 31
WORKDAY = (time(9, 0), time(17, 0))  # in the window's time zone
WORKDAYS = frozenset(range(5))  # Monday to Friday
SAID_SLOTS = 3
UTC = timezone.utc


class GetCalendarAvailabilityParameters(Schema):
    start = fields.String(validate=[validate.Length(max=64), valid_datetime],
                          metadata={"description": "Start of the window, ISO 8601 (default: now); "
                                                   "a time without an offset is read in timezone"})
    end = fields.String(validate=[validate.Length(max=64), valid_datetime],
                        metadata={"description": "End of the window, ISO 8601 (default: 7 days after the start; "
                                                 "at most 31 days after it)"})
    duration_minutes = fields.Integer(load_default=30, validate=validate.Range(min=5, max=480),
                                      metadata={"description": "Only free slots at least this long, in minutes"})
    timezone = fields.String(load_default="UTC", validate=[validate.Length(min=1, max=64), valid_timezone],
                             metadata={"description": "IANA time zone for the window and the working hours "
                                                      "(09:00-17:00, Monday to Friday); default UTC"})

    @validates_schema
    def _window(self, data: dict[str, Any], **_: Any) -> None:
        tz = calendar.zone(data.get("timezone") or "UTC")
        if "end" not in data:
            return
        end = calendar.parse_datetime(data["end"], tz)
        start = calendar.parse_datetime(data["start"], tz) if "start" in data else datetime.now(UTC)
        if end <= start:
            raise ValidationError("Must be after the start" + ("." if "start" in data else " (now)."),
                                  field_name="end")
        if end - start > timedelta(days=MAX_DAYS):
            raise ValidationError(f"The window can be at most {MAX_DAYS} days long.", field_name="end")


# -- the window and the free time (plain functions of times) ----------------------------------

def round_up(moment: datetime, minutes: int = 15) -> datetime:
    """The next quarter hour at or after ``moment`` (seconds dropped)."""
    moment = moment.astimezone(UTC).replace(second=0, microsecond=0) + (
        timedelta(minutes=1) if moment.second or moment.microsecond else timedelta())
    return moment + timedelta(minutes=-moment.minute % minutes)


def window(parameters: Mapping[str, Any], now: datetime | None = None) -> tuple[datetime, datetime, Any]:
    """``(start, end, tz)`` of the request: aware datetimes in UTC, and the time zone."""
    tz = calendar.zone(parameters.get("timezone") or "UTC")
    start = (calendar.parse_datetime(parameters["start"], tz) if parameters.get("start")
             else round_up(now or datetime.now(UTC)))
    end = (calendar.parse_datetime(parameters["end"], tz) if parameters.get("end")
           else start + timedelta(days=DEFAULT_DAYS))
    return start.astimezone(UTC), end.astimezone(UTC), tz


def working_hours(start: datetime, end: datetime, tz: Any) -> list[tuple[datetime, datetime]]:
    """The working hours within ``[start, end)``, as UTC intervals (DST handled by the time zone)."""
    spans = []
    day: date = start.astimezone(tz).date()
    last: date = end.astimezone(tz).date()
    while day <= last:
        if day.weekday() in WORKDAYS:
            opens = datetime.combine(day, WORKDAY[0], tzinfo=tz).astimezone(UTC)
            closes = datetime.combine(day, WORKDAY[1], tzinfo=tz).astimezone(UTC)
            s, e = max(opens, start), min(closes, end)
            if s < e:
                spans.append((s, e))
        day += timedelta(days=1)
    return spans


def free_slots(start: datetime, end: datetime, busy: Iterable[tuple[datetime, datetime]], minutes: int,
               tz: Any) -> list[tuple[datetime, datetime]]:
    """Working hours in ``[start, end)`` minus ``busy``, the gaps at least ``minutes`` long (UTC)."""
    taken = sorted((s.astimezone(UTC), e.astimezone(UTC)) for s, e in busy)
    least = timedelta(minutes=minutes)
    slots = []
    for opens, closes in working_hours(start.astimezone(UTC), end.astimezone(UTC), tz):
        cursor = opens
        for s, e in taken:
            if e <= cursor or s >= closes:
                continue
            if s - cursor >= least:
                slots.append((cursor, s))
            cursor = max(cursor, e)
        if closes - cursor >= least:
            slots.append((cursor, closes))
    return slots


# -- the steps --------------------------------------------------------------------------------

def plan(step: StepInput) -> dict[str, Any]:
    start, end, tz = window(step.parameters)
    if end <= start:
        raise PermanentError("the end of the window is not after its start")
    return {"start": start.astimezone(tz).isoformat(), "end": end.astimezone(tz).isoformat(), "timezone": str(tz),
            "duration_minutes": int(step.parameters.get("duration_minutes") or 30)}


def _planned(step: StepInput) -> tuple[datetime, datetime, Any, dict[str, Any]]:
    planned = step.outputs["PLANNING"]
    tz = calendar.zone(planned["timezone"])
    return calendar.parse_datetime(planned["start"]), calendar.parse_datetime(planned["end"]), tz, planned


def check_calendar(step: StepInput) -> dict[str, Any]:
    start, end, tz, _ = _planned(step)
    periods = calendar.busy(start, end, step.caller)
    return {"busy": [{"start": p["start"].astimezone(tz).isoformat(), "end": p["end"].astimezone(tz).isoformat()}
                     for p in periods]}


def find_free_time(step: StepInput) -> dict[str, Any]:
    start, end, tz, planned = _planned(step)
    busy = [(calendar.parse_datetime(p["start"]), calendar.parse_datetime(p["end"]))
            for p in step.outputs["CHECKING_CALENDAR"]["busy"]]
    slots = free_slots(start, end, busy, planned["duration_minutes"], tz)
    return {"free": [{"start": s.astimezone(tz).isoformat(), "end": e.astimezone(tz).isoformat()} for s, e in slots]}


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    return {"busy": outputs["CHECKING_CALENDAR"]["busy"], "free": outputs["FINDING_FREE_TIME"]["free"],
            "window": dict(outputs["PLANNING"])}


class Period(Schema):
    start = fields.String(required=True, metadata={"description": "ISO 8601, in the window's time zone"})
    end = fields.String(required=True, metadata={"description": "ISO 8601, in the window's time zone"})


class Window(Schema):
    start = fields.String(required=True)
    end = fields.String(required=True)
    timezone = fields.String(required=True)
    duration_minutes = fields.Integer(required=True)


class GetCalendarAvailabilityResult(Schema):
    busy = fields.List(fields.Nested(Period), required=True, metadata={"description": "Busy periods, in order"})
    free = fields.List(fields.Nested(Period), required=True,
                       metadata={"description": "Free slots in working hours at least duration_minutes long"})
    window = fields.Nested(Window, required=True, metadata={"description": "The window looked at"})


# -- what is said -----------------------------------------------------------------------------

def _hour(moment: datetime) -> str:
    hour = moment.hour % 12 or 12
    return f"{hour}" if moment.minute == 0 else f"{hour}:{moment.minute:02d}"


def _named(moment: datetime) -> str | None:
    if moment.minute == 0 and moment.hour == 12:
        return "noon"
    if moment.minute == 0 and moment.hour == 0:
        return "midnight"
    return None


def _meridiem(moment: datetime) -> str:
    return "a.m." if moment.hour < 12 else "p.m."


def spoken_time(moment: datetime) -> str:
    """``10 a.m.``, ``2:30 p.m.``, ``noon``."""
    return _named(moment) or f"{_hour(moment)} {_meridiem(moment)}"


def spoken_range(start: datetime, end: datetime) -> str:
    """``from 2 to 4 p.m.``, ``from 9:30 a.m. to noon``, ``from 11 a.m. to 1 p.m.``."""
    if not _named(start) and not _named(end) and _meridiem(start) == _meridiem(end):
        return f"from {_hour(start)} to {_hour(end)} {_meridiem(end)}"
    return f"from {spoken_time(start)} to {spoken_time(end)}"


def spoken_day(moment: datetime, today: date) -> str:
    """``today``, ``tomorrow``, ``Thursday`` (within the week ahead), else ``Monday, November 30``."""
    ahead = (moment.date() - today).days
    if ahead == 0:
        return "today"
    if ahead == 1:
        return "tomorrow"
    if 1 < ahead < 7:
        return f"{moment:%A}"
    return calendar.full_day(moment)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    result = result or {}
    planned = result.get("window") or {}
    tz = calendar.zone(planned.get("timezone") or parameters.get("timezone") or "UTC")
    today = datetime.now(tz).date()
    free = [(calendar.parse_datetime(f["start"]).astimezone(tz), calendar.parse_datetime(f["end"]).astimezone(tz))
            for f in result.get("free") or []]
    if free:
        said = [f"{spoken_day(s, today)} {spoken_range(s, e)}" for s, e in free[:SAID_SLOTS]]
        more = len(free) - SAID_SLOTS
        tail = f", plus {more} more free time{'s' if more != 1 else ''}" if more > 0 else ""
        return _sentence(f"You're free {_join(said)}{tail}")
    minutes = planned.get("duration_minutes") or parameters.get("duration_minutes") or 30
    if planned.get("start") and planned.get("end"):
        s = calendar.parse_datetime(planned["start"]).astimezone(tz)
        e = calendar.parse_datetime(planned["end"]).astimezone(tz)
        between = f" between {spoken_day(s, today)} at {spoken_time(s)} and {spoken_day(e, today)} at {spoken_time(e)}"
    else:
        between = ""
    return _sentence(f"You have no free {minutes}-minute slot in working hours{between}")


def _sentence(text: str) -> str:
    """``text`` with its full stop (one: a sentence ending in "p.m." has it already)."""
    return text if text.endswith(".") else text + "."


def confirmation_message(parameters: Mapping[str, Any], **_: Any) -> str:
    return f"Ready to check your calendar for free {parameters.get('duration_minutes') or 30}-minute slots. " \
           "Confirm to proceed."


TOOL = Tool(
    name="get_calendar_availability",
    description="Say when the caller is busy and free (working hours, 9 to 5 Monday to Friday, in the given "
                "time zone) between two times, by default the next 7 days.",
    schema=GetCalendarAvailabilityParameters,
    action_level="read",
    steps=(
        Step("PLANNING", run=plan, message="Working out the time window."),
        Step("CHECKING_CALENDAR", run=check_calendar, message="Checking your calendar."),
        Step("FINDING_FREE_TIME", run=find_free_time, message="Finding your free time."),
        Step("COMPLETED", message="Calendar checked."),
    ),
    result=result,
    result_schema=GetCalendarAvailabilityResult,
    confirmation_message=confirmation_message,
    start_message="Checking your calendar.",
    modified_message="Updated: I'll look for free {duration_minutes}-minute slots. Confirm?",
    voice_response=voice_response,
    failure_response="I couldn't check your calendar: {error}.",
    cancelled_response="Cancelled. Your calendar was not checked.",
    time_limit=30,
    example={"duration_minutes": 30, "timezone": "Europe/London"},
)
