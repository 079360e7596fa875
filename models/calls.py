"""The tables of a tool call's life: the call, its session context and its callback events."""
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

PENDING = "PENDING"
MODIFIED = "MODIFIED"
EXECUTING = "EXECUTING"
PREPARED = "PREPARED"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
EXPIRED = "EXPIRED"

STATUSES = (PENDING, MODIFIED, EXECUTING, PREPARED, COMPLETED, FAILED, CANCELLED, EXPIRED)
TERMINAL = (COMPLETED, FAILED, CANCELLED, EXPIRED)
# the faces an action on a call comes through, named on its status_history entry (``via``); the
# relay's answer to a callback is ``callback``
FACES = ("REST", "MCP", "console", "CLI", "beat", "callback")
OPEN = (PENDING, MODIFIED, EXECUTING, PREPARED)
ACTION_LEVELS = ("read", "draft", "write")
# the kind of request that recorded a call (migration 0008): an idempotent replay is the
# same call only on the same kind (docs/promises.md, Idempotency)
REQUEST_KINDS = ("pending", "execute")
# whether a call's action happened (docs/promises.md, "Exactly once"): null while it is open
DONE, NOT_DONE, UNCONFIRMED = "done", "not_done", "unconfirmed"
OUTCOMES = (DONE, NOT_DONE, UNCONFIRMED)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSONB, list[Any]: JSONB}


class ToolCall(Base):
    __tablename__ = "tool_calls"
    __table_args__ = (
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")", name="valid_status"
        ),
        CheckConstraint("action_level IN ('read', 'draft', 'write')", name="valid_action_level"),
        CheckConstraint("progress >= 0 AND progress <= 1", name="valid_progress"),
        CheckConstraint("request_kind IN ('pending', 'execute')", name="valid_request_kind"),
        CheckConstraint("outcome IS NULL OR outcome IN ('done', 'not_done', 'unconfirmed')", name="valid_outcome"),
        Index("idx_tool_calls_session", "session_id", text("created_at DESC")),
        Index("idx_tool_calls_status", "session_id", "status"),
        Index("idx_tool_calls_open_status", "status", "created_at",
              postgresql_where=text("status IN ('PENDING', 'PREPARED', 'EXECUTING')")),
        # the retention purge's way to the oldest ended calls (models/retention.py)
        Index("idx_tool_calls_ended", "completed_at",
              postgresql_where=text("status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')")),
        # the console's list, newest first by keyset: every call, a caller's own, one tool's (models/browse.py)
        Index("idx_tool_calls_created", "created_at", "tool_call_id"),
        Index("idx_tool_calls_caller_created", "caller", "created_at", "tool_call_id"),
        Index("idx_tool_calls_tool_created", "function_name", "created_at", "tool_call_id"),
        # idempotency keys are per caller (docs/promises.md, Callers); a call with no caller counts as ''
        Index("uq_tool_calls_caller_idempotency_key", func.coalesce(text("caller"), text("''")), "idempotency_key",
              unique=True, postgresql_where=text("idempotency_key IS NOT NULL")),
    )

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")
    )
    tool_call_id: Mapped[str] = mapped_column(String(100), unique=True, nullable=False)
    session_id: Mapped[str] = mapped_column(String(100), nullable=False)
    connection_id: Mapped[str | None] = mapped_column(String(100))
    intent_id: Mapped[str | None] = mapped_column(String(100))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    function_name: Mapped[str] = mapped_column(String(100), nullable=False)
    action_level: Mapped[str] = mapped_column(String(10), nullable=False)
    parameters: Mapped[dict[str, Any]] = mapped_column(nullable=False, server_default=text("'{}'::jsonb"))
    parameters_history: Mapped[list[Any]] = mapped_column(nullable=False, server_default=text("'[]'::jsonb"))
    status: Mapped[str] = mapped_column(String(20), nullable=False, server_default=PENDING)
    status_history: Mapped[list[Any]] = mapped_column(nullable=False, server_default=text("'[]'::jsonb"))
    current_step: Mapped[str | None] = mapped_column(String(50))
    progress: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    step_outputs: Mapped[dict[str, Any]] = mapped_column(nullable=False, server_default=text("'{}'::jsonb"))
    committed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    callback_url: Mapped[str | None] = mapped_column(Text)
    # per-event URLs (``{"checkpoint": url, "completed": url, ...}``); events not named go to callback_url
    callback_urls: Mapped[dict[str, str] | None] = mapped_column(JSONB)
    workflow_id: Mapped[str | None] = mapped_column(String(100))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    error_message: Mapped[str | None] = mapped_column(Text)
    voice_response: Mapped[str | None] = mapped_column(Text)
    context_key: Mapped[str | None] = mapped_column(String(100))
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # how often the stuck-call sweep ran a committed call's chain again (capped)
    redrives: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    event_seq: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # the side-effect step's claim (migration 0010): held until ``effect_claimed_until`` by the
    # attempt whose token is ``effect_claimed_by``; ``effect_attempts`` claims of it so far
    effect_claimed_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    effect_claimed_by: Mapped[str | None] = mapped_column(Text)  # a token: tasks/effect_claims.py (migration 0020)
    effect_attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # runs of the current step (the bound of its retries)
    step_attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # the latest runs of its links, each with its start, time taken, outcome and retry's reason
    # (models/link_attempts.py; migration 0022)
    link_attempts: Mapped[list[Any]] = mapped_column(nullable=False, server_default=text("'[]'::jsonb"))
    # done, not_done or unconfirmed once the call has ended
    outcome: Mapped[str | None] = mapped_column(String(12))
    caller: Mapped[str | None] = mapped_column(String(100))
    request_kind: Mapped[str] = mapped_column(String(10), nullable=False, server_default="pending")
    # the W3C traceparent of the span that recorded the call, with tracing on (voice_tools_tracing/): a later
    # request about the call joins its trace; null with tracing off (migration 0018)
    trace_context: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    confirmed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    executed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    prepared_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    resumed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # when a link last passed a side effect's gate (begin_step) or recorded its step: the stuck-call sweep's sign of life
    step_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    execution_time_ms: Mapped[int | None] = mapped_column(Integer)


class SessionContext(Base):
    __tablename__ = "session_context"
    __table_args__ = (
        # a caller's own: another caller's session of the same id has its own values
        UniqueConstraint("caller", "session_id", "context_key", name="uq_session_context_key"),
        Index("idx_session_context_expires", "expires_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")
    )
    session_id: Mapped[str] = mapped_column(String(100), nullable=False)
    context_key: Mapped[str] = mapped_column(String(100), nullable=False)
    context_value: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    # the caller of the call that stored it ('' for a call recorded without one)
    caller: Mapped[str] = mapped_column(String(100), nullable=False, server_default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class CallbackDelivery(Base):
    __tablename__ = "callback_deliveries"
    __table_args__ = (
        UniqueConstraint("tool_call_id", "seq", name="uq_callback_seq"),
        CheckConstraint("state IN ('pending', 'delivered', 'failed', 'none')", name="valid_delivery_state"),
        Index("idx_callback_due", "next_attempt_at", postgresql_where=text("state = 'pending'")),
        Index("idx_callback_session_order", "session_id", "commit_seq"),
        # the retention purge's way to the oldest settled events (models/retention.py)
        Index("idx_callback_settled", "created_at", postgresql_where=text("state <> 'pending'")),
    )

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")
    )
    event_id: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    tool_call_id: Mapped[str] = mapped_column(
        String(100), ForeignKey("tool_calls.tool_call_id", ondelete="CASCADE"), nullable=False
    )
    event: Mapped[str] = mapped_column(String(20), nullable=False)
    seq: Mapped[int] = mapped_column(Integer, nullable=False)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    # null (state "none"): no URL takes this event; it is recorded for the session's event stream
    url: Mapped[str | None] = mapped_column(Text)
    session_id: Mapped[str] = mapped_column(String(100), nullable=False)
    # the stream's order (migration 0012): numbered when the inserting transaction commits, in
    # commit order (null until then; models/listen.py says why the order has no gaps a reader can miss)
    commit_seq: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(10), nullable=False, server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    last_error: Mapped[str | None] = mapped_column(Text)
    attempt_log: Mapped[list[Any]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'::jsonb"))
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    response_code: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class SweepRun(Base):
    """One beat sweep's run in one period (migration 0014): the first of any number of beats' sends
    of a sweep in a period inserts its row and runs; the others find the row and do nothing
    (``models/sweep_runs.py``)."""

    __tablename__ = "sweep_runs"

    sweep: Mapped[str] = mapped_column(String(100), primary_key=True)
    # the period's start: the database's clock floored to a multiple of the sweep's period
    period_start: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    claimed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    # the worker that ran it (its Celery hostname and process id)
    claimed_by: Mapped[str | None] = mapped_column(String(200))
