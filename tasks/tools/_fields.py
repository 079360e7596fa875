"""Parameter validators shared by tools (not a tool: the registry skips modules without ``TOOL``)."""
from __future__ import annotations

from marshmallow import ValidationError

from voice_tools_backends import calendar


def valid_timezone(name: str) -> None:
    """An IANA time zone name (Europe/London)."""
    try:
        calendar.zone(name)
    except ValueError as exc:
        raise ValidationError("Not a known time zone: use an IANA name such as Europe/London or America/New_York.") \
            from exc


def valid_datetime(text: str) -> None:
    """An ISO 8601 date, or date and time."""
    try:
        calendar.parse_datetime(text)
    except ValueError as exc:
        raise ValidationError("Not an ISO 8601 date or date and time, such as 2026-11-24T09:00:00.") from exc
