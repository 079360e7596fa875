"""The session-context store: what one call leaves for a later call of the same session
(``context_key``), each value its caller's own, until it expires.

Values are written by a tool's step (``query_vector_db``), read by another's
(``send_email``) and by ``GET /voice-tools/context``, and purged by beat in batches
(``models/retention.py``).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from models.calls import SessionContext


def put_context(s: Session, session_id: str, context_key: str, value: dict[str, Any], ttl_s: int,
                caller: str | None = None) -> datetime:
    """Store ``caller``'s value (the caller of the call storing it; '' for none)."""
    stmt = (
        insert(SessionContext)
        .values(caller=caller or "", session_id=session_id, context_key=context_key, context_value=value,
                expires_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, ttl_s))
    )
    stmt = stmt.on_conflict_do_update(
        constraint="uq_session_context_key",
        set_={"context_value": stmt.excluded.context_value, "expires_at": stmt.excluded.expires_at,
              "created_at": func.now()},
    ).returning(SessionContext.expires_at)
    return s.scalars(stmt).one()


def get_context(s: Session, session_id: str, context_key: str, caller: str | None = None) -> SessionContext | None:
    """``caller``'s unexpired value ('' for a call with no caller); with ``caller`` None (an
    operator), the newest of any caller's."""
    owned = [] if caller is None else [SessionContext.caller == caller]
    return s.scalars(
        select(SessionContext).where(
            SessionContext.session_id == session_id,
            SessionContext.context_key == context_key,
            (SessionContext.expires_at.is_(None)) | (SessionContext.expires_at > func.now()),
            *owned,
        ).order_by(SessionContext.created_at.desc()).limit(1)
    ).one_or_none()
