"""The local task list's table, written by create_task (used when no Google Tasks credentials are set).

Named ``todo_tasks``, not ``tasks``, so it is not confused with the Celery package.
"""
from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import CheckConstraint, Date, DateTime, Index, String, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from models.calls import Base

PRIORITIES = ("low", "medium", "high")


class TodoTask(Base):
    """One to-do of ``owner`` (the caller of the call that added it); ``tool_call_id`` unique so a call
    never adds two (its ``id`` is derived from it too)."""

    __tablename__ = "todo_tasks"
    __table_args__ = (
        CheckConstraint("priority IN ('low', 'medium', 'high')", name="ck_todo_tasks_priority"),
        CheckConstraint("status IN ('needsAction', 'completed')", name="ck_todo_tasks_status"),
        Index("ix_todo_tasks_owner", "owner"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tool_call_id: Mapped[str] = mapped_column(String(100), unique=True, nullable=False)
    owner: Mapped[str] = mapped_column(String(100), nullable=False, server_default="")  # docs/promises.md, Callers
    title: Mapped[str] = mapped_column(String(500), nullable=False)
    notes: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
    due: Mapped[date | None] = mapped_column(Date)
    priority: Mapped[str] = mapped_column(String(10), nullable=False, server_default="medium")
    status: Mapped[str] = mapped_column(String(20), nullable=False, server_default="needsAction")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
