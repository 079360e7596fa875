"""The local calendar backend's table (used when no Google Calendar credentials are set).

schedule_meeting books into it and get_calendar_availability reads it, so a meeting
just booked shows as busy. ``id`` is derived from the call (``vt`` + SHA-256 of the
tool_call_id, the same id the Google backend gives the event) or, for the demo
data, from the ISO week and a fixed key (``demo-2026w48-tue-2``). ``owner`` is the caller
whose call booked it ( for the shared demo meetings): a caller sees only its own and the
shared ones.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, Index, String, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.calls import Base


class CalendarEvent(Base):
    """One meeting; ``tool_call_id`` unique so a call never books twice (NULL for demo rows)."""

    __tablename__ = "calendar_events"
    __table_args__ = (
        CheckConstraint("ends_at > starts_at", name="calendar_event_ends_after_start"),
        Index("idx_calendar_events_owner_span", "owner", "starts_at", "ends_at"),
    )

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    owner: Mapped[str] = mapped_column(String(100), nullable=False, server_default="")  # docs/promises.md, Callers
    title: Mapped[str] = mapped_column(Text, nullable=False)
    starts_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    ends_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    timezone: Mapped[str] = mapped_column(String(64), nullable=False, server_default="UTC")
    attendees: Mapped[list[Any]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'::jsonb"))
    description: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
    tool_call_id: Mapped[str | None] = mapped_column(String(100), unique=True, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
