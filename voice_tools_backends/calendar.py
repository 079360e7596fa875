"""The calendar: busy times and booking, for schedule_meeting and get_calendar_availability.

Two implementations behind the same two calls, :func:`busy` and :func:`book`:

- local (default, no credentials): the ``calendar_events`` table (``models/calendar.py``);
  a meeting booked by schedule_meeting shows as busy to get_calendar_availability;
- Google Calendar, when ``settings.load().uses_google("calendar")``: ``freebusy.query``
  and ``events.insert`` on the calendar named by ``VOICE_TOOLS_GOOGLE_CALENDAR_ID``
  (default ``primary``); scopes ``calendar.freebusy`` + ``calendar.events``.

Locally a meeting belongs to the caller whose call booked it (``owner``) and a caller's
:func:`busy` sees only its own meetings and the shared demo ones; on Google each caller
uses its own credentials where they are configured (``voice_tools_backends/google.py``).

Never twice for one call: the event id is derived from the tool_call_id
(:func:`event_id_for`: ``vt`` + the SHA-256 hex of the id, valid for Google, whose
ids are base32hex characters a-v0-9, 5 to 1024 long). Locally the INSERT does nothing
on a conflict and the row is read back; on Google an ``events.insert`` answered 409
("already exists") means an earlier run of the same link booked it, and the event is
read back with ``events.get``, asked again with backoff for ``VOICE_TOOLS_GOOGLE_CONFIRM_WAIT``
seconds (a read that lags); not shown by then: :class:`Unconfirmed`, never "not booked". A refused insert is checked the same way (an earlier
request, a 5xx that booked or a lost answer, may have booked it): the event (booked), 404
(nothing booked: the refusal stands), or no answer: :class:`Unconfirmed` when an earlier
attempt may have acted (``earlier_attempt``), never "not booked".

Errors: :class:`Refused` when the service refused the request (400, 401, 403 other
than a rate limit, 404, a calendar freebusy cannot read, unusable credentials):
nothing was booked by it. :class:`Unavailable` for a 403 rate limit, a freebusy
backend error or a transport failure: worth retrying. 429 and 5xx ``HttpError``\\ s,
timeouts and connection errors go through as they are (the engine retries them).

Also here, shared by both calendar tools: reading the times a caller gives
(:func:`zone`, :func:`parse_datetime`) and saying times aloud.
"""
from __future__ import annotations

import hashlib
import json
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Iterable
from zoneinfo import ZoneInfo

from google.auth.exceptions import RefreshError
from sqlalchemy import DateTime, String, bindparam, select
from sqlalchemy.dialects.postgresql import insert

from models import db, settings
from models.compiled import Compiled
from models.calendar import CalendarEvent
from voice_tools_backends import google
from voice_tools_backends.google import HttpError
from voice_tools_backends import SHARED, Refused, Unavailable, Unconfirmed

CALENDAR_ID_VARIABLE = "VOICE_TOOLS_GOOGLE_CALENDAR_ID"
REFUSED_STATUSES = frozenset({400, 401, 403, 404, 410})
RATE_LIMIT_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded", "quotaExceeded"})
RETRYABLE_FREEBUSY_REASONS = frozenset({"internalError", "backendError"})
UTC = timezone.utc




# -- ids ---------------------------------------------------------------------------------

def event_id_for(tool_call_id: str) -> str:
    """The event id of a call's meeting: ``vt`` + 64 hex characters (a valid Google event id)."""
    return "vt" + hashlib.sha256(tool_call_id.encode()).hexdigest()


def calendar_id() -> str:
    """The Google calendar booked into and read (``VOICE_TOOLS_GOOGLE_CALENDAR_ID``, default ``primary``)."""
    return settings.load().google_calendar_id


def uses_google() -> bool:
    return settings.load().uses_google("calendar")


# -- the two calls -------------------------------------------------------------------------

def busy(start: datetime, end: datetime, caller: str = "") -> list[dict[str, Any]]:
    """``caller``'s busy periods overlapping ``[start, end)``, clipped to it, in order.

    Each is ``{start, end, title}`` (aware UTC datetimes; ``title`` is None on Google,
    whose freebusy says only when).
    """
    periods = (GoogleCalendar(caller=caller).busy(start, end) if uses_google()
               else LocalCalendar().busy(start, end, caller))
    return clip_and_merge(periods, start, end)


def book(meeting: dict[str, Any], caller: str = "", earlier_attempt: bool = False) -> dict[str, Any]:
    """Book ``meeting`` once in ``caller``'s calendar; return ``{event_id, start, end, html_link}`` (ISO
    times in its time zone; ``html_link`` is Google Calendar's page of the event, None on the local
    calendar, which has no page).

    ``meeting``: ``event_id``, ``tool_call_id``, ``title``, ``start``, ``end`` (ISO 8601
    with offset), ``timezone``, ``attendees``, ``description``. ``earlier_attempt``: an earlier
    attempt of the booking may have acted (Google: a refusal is then checked against the event id).
    """
    if uses_google():
        return GoogleCalendar(caller=caller).book(meeting, earlier_attempt=earlier_attempt)
    return LocalCalendar().book(meeting, caller)


def clip_and_merge(periods: Iterable[dict[str, Any]], start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Overlapping or touching periods merged (the first one's title kept), clipped to ``[start, end)``."""
    merged: list[dict[str, Any]] = []
    for p in sorted(periods, key=lambda p: (p["start"], p["end"])):
        s, e = max(p["start"], start), min(p["end"], end)
        if s >= e:
            continue
        if merged and s <= merged[-1]["end"]:
            merged[-1]["end"] = max(merged[-1]["end"], e)
            continue
        merged.append({"start": s, "end": e, "title": p.get("title")})
    return merged


# -- local: the calendar_events table ------------------------------------------------------

# built once: the events of b_caller (and the shared ones) overlapping [b_start, b_end), in order
_BUSY = Compiled(select(CalendarEvent.starts_at, CalendarEvent.ends_at, CalendarEvent.title)
                  .where(CalendarEvent.owner.in_([bindparam("b_caller", type_=String()), SHARED]),
                         CalendarEvent.starts_at < bindparam("b_end", type_=DateTime(timezone=True)),
                         CalendarEvent.ends_at > bindparam("b_start", type_=DateTime(timezone=True)))
                  .order_by(CalendarEvent.starts_at, CalendarEvent.id))


class LocalCalendar:
    def busy(self, start: datetime, end: datetime, caller: str = "") -> list[dict[str, Any]]:
        with db.statement() as conn:  # one SELECT, one round trip (no BEGIN/COMMIT), prepared (models/compiled.py)
            return [{"start": e.starts_at.astimezone(UTC), "end": e.ends_at.astimezone(UTC), "title": e.title}
                    for e in _BUSY.all(conn, {"b_caller": caller or "", "b_start": start, "b_end": end})]

    def book(self, meeting: dict[str, Any], caller: str = "") -> dict[str, Any]:
        with db.session() as s:
            s.execute(
                insert(CalendarEvent)
                .values(
                    id=meeting["event_id"],
                    owner=caller or "",
                    title=meeting["title"],
                    starts_at=parse_datetime(meeting["start"]),
                    ends_at=parse_datetime(meeting["end"]),
                    timezone=meeting["timezone"],
                    attendees=list(meeting.get("attendees") or []),
                    description=meeting.get("description") or "",
                    tool_call_id=meeting.get("tool_call_id"),
                )
                .on_conflict_do_nothing()
            )
            event = s.scalars(select(CalendarEvent).where(CalendarEvent.id == meeting["event_id"],
                                                          CalendarEvent.owner == (caller or ""))).one_or_none()
            if event is None:  # another row holds this call's id or tool_call_id: impossible with derived ids
                raise Refused(f"event {meeting['event_id']} could not be stored")
            tz = zone(event.timezone)
            return {"event_id": event.id, "start": event.starts_at.astimezone(tz).isoformat(),
                    "end": event.ends_at.astimezone(tz).isoformat(), "html_link": None}  # no page to open


# -- Google Calendar -----------------------------------------------------------------------

class GoogleCalendar:
    """``freebusy.query`` and ``events.insert`` on one calendar.

    ``service`` (a ``calendar`` v3 client, e.g. built on an ``HttpMockSequence``)
    defaults to this thread's client for ``caller`` from the settings; ``calendar`` to
    :func:`calendar_id`.
    """

    def __init__(self, service: Any = None, calendar: str | None = None, caller: str = "") -> None:
        self._service = service
        self.calendar = calendar or calendar_id()
        self.caller = caller

    @property
    def service(self) -> Any:
        if self._service is None:
            self._service = google.service("calendar", "v3", caller=self.caller)
        return self._service

    def busy(self, start: datetime, end: datetime) -> list[dict[str, Any]]:
        body = {"timeMin": rfc3339(start), "timeMax": rfc3339(end), "timeZone": "UTC",
                "items": [{"id": self.calendar}]}
        answer = _call(lambda: self.service.freebusy().query(body=body).execute())
        found = (answer.get("calendars") or {}).get(self.calendar)
        if found is None:
            raise Refused(f"Google Calendar gave no free/busy information for calendar {self.calendar}")
        errors = found.get("errors") or []
        if errors:
            reasons = {e.get("reason", "") for e in errors}
            if reasons & RETRYABLE_FREEBUSY_REASONS:
                raise Unavailable(f"Google Calendar could not read calendar {self.calendar} for now")
            if "notFound" in reasons:
                raise Refused(f"calendar {self.calendar} was not found")
            raise Refused(f"Google Calendar could not read calendar {self.calendar} ({', '.join(sorted(reasons))})")
        return [{"start": parse_datetime(p["start"]).astimezone(UTC), "end": parse_datetime(p["end"]).astimezone(UTC),
                 "title": None} for p in found.get("busy") or []]

    def book(self, meeting: dict[str, Any], earlier_attempt: bool = False) -> dict[str, Any]:
        body = insert_body(meeting)
        kwargs: dict[str, Any] = {"calendarId": self.calendar, "body": body}
        if body.get("attendees"):
            kwargs["sendUpdates"] = "all"
        events = lambda: self.service.events()  # noqa: E731
        try:
            event = _call(lambda: events().insert(**kwargs).execute(), translate_conflict=False)
        except HttpError as exc:
            if google.status_of(exc) != 409:
                raise
            # "The requested identifier already exists": an earlier run of this link booked it; its
            # read-back may lag, and a get that does not show it is never taken for "not booked"
            event = google.within_bound(lambda: events().get(calendarId=self.calendar, eventId=body["id"]).execute())
            if event is None:
                raise Unconfirmed("Google Calendar has the event but did not show it") from exc
        except Refused as refused:  # an earlier request (a 5xx that booked, a lost answer) may have booked it
            event = self._booked_earlier(body["id"], refused, earlier_attempt)
        tz = zone(meeting["timezone"])
        return {"event_id": event["id"], "start": _event_time(event, "start", tz),
                "end": _event_time(event, "end", tz), "html_link": event.get("htmlLink") or None}


    def _booked_earlier(self, event_id: str, refused: Refused, earlier_attempt: bool) -> dict[str, Any]:
        """After a refused insert, the event an earlier request booked; Refused again when the calendar
        has no event with its id (nothing was booked); when the calendar will not say, Unconfirmed
        if an earlier attempt may have acted, else the refusal (this request did nothing)."""
        try:
            return self.service.events().get(calendarId=self.calendar, eventId=event_id).execute()
        except (HttpError, *google.transport_errors()) as exc:
            if google.status_of(exc) in (404, 410) or not earlier_attempt:
                raise refused from exc
            raise Unconfirmed(f"Google Calendar did not show whether it was booked ({refused})") from exc


def insert_body(meeting: dict[str, Any]) -> dict[str, Any]:
    """The ``events.insert`` body of a meeting, with its fixed id."""
    body: dict[str, Any] = {
        "id": meeting["event_id"],
        "summary": meeting["title"],
        "start": {"dateTime": meeting["start"], "timeZone": meeting["timezone"]},
        "end": {"dateTime": meeting["end"], "timeZone": meeting["timezone"]},
    }
    if meeting.get("description"):
        body["description"] = meeting["description"]
    if meeting.get("attendees"):
        body["attendees"] = [{"email": address} for address in meeting["attendees"]]
    return body


def _event_time(event: dict[str, Any], key: str, tz: ZoneInfo) -> str:
    when = event.get(key) or {}
    if when.get("dateTime"):
        return parse_datetime(when["dateTime"]).astimezone(tz).isoformat()
    return when.get("date") or ""  # an all-day event (not one we make)


def _call(request: Any, translate_conflict: bool = True) -> dict[str, Any]:
    """Run one API request, turning the answers we understand into Refused / Unavailable."""
    try:
        return request()
    except HttpError as exc:
        status = google.status_of(exc)
        if status == 409 and not translate_conflict:
            raise
        if status == 403 and _reasons(exc) & RATE_LIMIT_REASONS:
            raise Unavailable(f"Google Calendar rate limit: {google.reason_of(exc)}") from exc
        if status in REFUSED_STATUSES or status == 409:
            raise Refused(google.reason_of(exc)) from exc
        raise  # 429 / 5xx: the engine retries
    except google.CredentialsError as exc:
        raise Refused(f"the Google credentials could not be used ({exc})") from exc
    except RefreshError as exc:
        if getattr(exc, "retryable", False):
            raise Unavailable(f"Google sign-in failed for now: {exc}") from exc
        raise Refused(f"Google refused the credentials: {exc}") from exc
    except google.transport_errors() as exc:
        raise Unavailable(f"Google Calendar could not be reached: {exc}") from exc


def _reasons(exc: HttpError) -> set[str]:
    try:
        return {e.get("reason", "") for e in json.loads(exc.content)["error"].get("errors", [])}
    except Exception:  # not JSON, or another shape
        return set()


# -- times --------------------------------------------------------------------------------

def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` (ValueError if there is none by that name)."""
    try:
        return ZoneInfo(name)
    except (KeyError, ValueError, OSError) as exc:
        raise ValueError(f"unknown time zone {name!r}") from exc


def parse_datetime(text: str, tz: ZoneInfo | None = None) -> datetime:
    """An ISO 8601 date-time; a naive one is read in ``tz`` (UTC if None). ValueError if unreadable."""
    value = datetime.fromisoformat(text.strip())
    if value.tzinfo is None:
        value = value.replace(tzinfo=tz or UTC)
    return value


def rfc3339(value: datetime) -> str:
    """``2026-11-24T14:00:00Z`` (UTC, seconds)."""
    return value.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def clock(value: datetime) -> str:
    """``2 p.m.``, ``9:30 a.m.``, ``noon``, ``midnight``: a time as a person says it."""
    if value.minute == 0 and value.hour in (0, 12):
        return "noon" if value.hour == 12 else "midnight"
    hour = value.hour % 12 or 12
    return f"{hour}{f':{value.minute:02d}' if value.minute else ''} {'a.m.' if value.hour < 12 else 'p.m.'}"


def full_day(value: datetime | date) -> str:
    """``Tuesday, November 24``."""
    return f"{value:%A}, {value:%B} {value.day}"


def spoken_duration(minutes: int) -> str:
    """``30 minutes``, ``1 hour``, ``1 hour 30 minutes``, ``2 hours``."""
    hours, rest = divmod(int(minutes), 60)
    parts = []
    if hours:
        parts.append(f"{hours} hour{'s' if hours != 1 else ''}")
    if rest or not hours:
        parts.append(f"{rest} minute{'s' if rest != 1 else ''}")
    return " ".join(parts)


# -- demo data ------------------------------------------------------------------------------

# (weekday 0 = Monday, key, start hour, start minute, minutes, title, attendees); times in UTC
DEMO_WEEK = (
    (0, "1", 9, 30, 15, "Team standup", ["team@example.com"]),
    (0, "2", 14, 0, 60, "Project sync", ["maria@example.com", "li@example.com"]),
    (1, "1", 9, 30, 15, "Team standup", ["team@example.com"]),
    (1, "2", 11, 0, 60, "Design review", ["ana@example.com"]),
    (2, "1", 9, 30, 15, "Team standup", ["team@example.com"]),
    (2, "2", 12, 0, 60, "Lunch with Sarah", ["sarah@example.com"]),
    (2, "3", 15, 0, 30, "One-to-one with Omar", ["omar@example.com"]),
    (3, "1", 9, 30, 15, "Team standup", ["team@example.com"]),
    (3, "2", 13, 0, 90, "Quarterly planning", ["leads@example.com"]),
    (4, "1", 9, 30, 15, "Team standup", ["team@example.com"]),
    (4, "2", 16, 0, 60, "Team retro", ["team@example.com"]),
)
DAY_KEYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def demo_events(today: date | None = None) -> list[dict[str, Any]]:
    """The demo meetings of the ISO week of ``today`` (UTC), ids ``demo-<year>w<week>-<day>-<n>``."""
    today = today or datetime.now(UTC).date()
    monday = today - timedelta(days=today.weekday())
    year, week, _ = monday.isocalendar()
    rows = []
    for weekday, key, hour, minute, minutes, title, attendees in DEMO_WEEK:
        start = datetime.combine(monday + timedelta(days=weekday), time(hour, minute), tzinfo=UTC)
        rows.append({"id": f"demo-{year}w{week:02d}-{DAY_KEYS[weekday]}-{key}", "title": title,
                     "starts_at": start, "ends_at": start + timedelta(minutes=minutes), "timezone": "UTC",
                     "attendees": attendees, "description": "Demo meeting", "tool_call_id": None})
    return rows


def load_demo() -> int:
    """Add this week's demo meetings to the local calendar (none twice); return how many were added."""
    with db.session() as s:
        added = s.scalars(
            insert(CalendarEvent).values(demo_events())
            .on_conflict_do_nothing(index_elements=["id"]).returning(CalendarEvent.id)
        ).all()
    return len(added)


__all__ = ["CALENDAR_ID_VARIABLE", "GoogleCalendar", "LocalCalendar", "Refused", "Unavailable", "book", "busy",
           "calendar_id", "clip_and_merge", "clock", "demo_events", "event_id_for", "full_day", "insert_body",
           "load_demo", "parse_datetime", "rfc3339", "spoken_duration", "uses_google", "zone"]
