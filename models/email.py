"""The local email backend's table: the outbox (used when no Gmail credentials are set)."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Index, Integer, String, Text, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.calls import Base


class EmailOutbox(Base):
    """One row per sent message of ``owner`` (the caller of the call that sent it); ``tool_call_id``
    unique so a call never sends twice."""

    __tablename__ = "email_outbox"
    __table_args__ = (Index("ix_email_outbox_owner", "owner"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tool_call_id: Mapped[str] = mapped_column(String(100), unique=True, nullable=False)
    owner: Mapped[str] = mapped_column(String(100), nullable=False, server_default="")  # docs/promises.md, Callers
    message_id: Mapped[str] = mapped_column(String(200), nullable=False)
    thread_id: Mapped[str] = mapped_column(String(100), nullable=False)
    headers: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    body: Mapped[str] = mapped_column(Text, nullable=False)
    sent_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
