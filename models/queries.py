"""Read-only questions of the calls: one call, a session's calls, the sweeps' selections,
and what operators ask (``celery -A tasks calls ...``).

Nothing here writes: every status change is a transition in ``models/lifecycle.py``
(which re-checks a sweep's condition from here in its own statement), and redelivering
goes through ``tasks/delivery/attempts.py``.
"""
from __future__ import annotations

import functools
from datetime import datetime, timedelta
from typing import Any, Iterable

from sqlalchemy import ColumnElement, Integer, Row, and_, any_, bindparam, cast, func, or_, select, union_all
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session
from sqlalchemy.types import String

from models.calls import (
    COMPLETED, EXECUTING, FAILED, OPEN, PENDING, PREPARED, STATUSES, TERMINAL, CallbackDelivery, ToolCall,
)
from models.compiled import Compiled
from models.db import Executor

CALLS = ToolCall.__table__


class NotFound(LookupError):
    def __init__(self, tool_call_id: str):
        super().__init__(f"No tool call {tool_call_id!r}")
        self.tool_call_id = tool_call_id


# -- one call, a session's calls ------------------------------------------------

# the API's reads (status, context): built once, run on the driver's cursor (models/compiled.py)
_GET_ANY = select(CALLS).where(ToolCall.tool_call_id == bindparam("p_id", type_=String))
_GET = {False: Compiled(_GET_ANY),
        True: Compiled(_GET_ANY.where(ToolCall.caller == bindparam("p_caller", type_=String)))}


def get(s: Executor, tool_call_id: str, caller: str | None = None) -> Row[Any]:
    """The call (a row); :class:`NotFound` when there is none or it is another caller's (``caller`` given)."""
    call = _GET[caller is not None].one_or_none(s, {"p_id": tool_call_id, "p_caller": caller})
    if call is None:
        raise NotFound(tool_call_id)
    return call


@functools.cache
def _session_calls(own: bool) -> Compiled:
    def newest(statuses: tuple[str, ...], name: str) -> Any:
        where = [ToolCall.caller == bindparam("p_caller", type_=String)] if own else []
        # = ANY of a constant array, not IN (a list SQLAlchemy expands at each run): one statement, prepared
        return (select(CALLS).where(ToolCall.session_id == bindparam("p_session", type_=String),
                                    ToolCall.status == any_(bindparam(name, list(statuses), type_=ARRAY(String))),
                                    *where)
                .order_by(ToolCall.created_at.desc()).limit(bindparam("p_limit", type_=Integer)))

    both = union_all(newest(OPEN, "p_open").subquery().select(),
                     newest(TERMINAL, "p_ended").subquery().select()).subquery()
    return Compiled(select(both).order_by(both.c.created_at.desc()))


def session_calls(s: Executor, session_id: str, limit: int,
                  caller: str | None = None) -> tuple[list[Row[Any]], list[Row[Any]]]:
    """(the ``limit`` most recent open calls, the ``limit`` most recent terminal calls), newest first;
    only ``caller``'s calls when given. One statement (built once); rows."""
    rows = _session_calls(caller is not None).all(s, {"p_session": session_id, "p_limit": limit, "p_caller": caller})
    return [r for r in rows if r.status in OPEN], [r for r in rows if r.status in TERMINAL]


# -- what the sweeps (beat) select ------------------------------------------------

def stale_where(pending_ttl_s: int, prepared_ttl_s: int) -> ColumnElement[bool]:
    """PENDING past its TTL (from creation), PREPARED past its TTL (from the checkpoint); never a
    call past its point of no return (its effect may have happened: it is not "unanswered")."""
    def older(column: Any, ttl: int) -> ColumnElement[bool]:
        return column < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, ttl)

    return and_(
        or_(and_(ToolCall.status == PENDING, older(ToolCall.created_at, pending_ttl_s)),
            and_(ToolCall.status == PREPARED, older(ToolCall.prepared_at, prepared_ttl_s))),
        ToolCall.committed_at.is_(None),
    )


def stale(s: Session, *, pending_ttl_s: int, prepared_ttl_s: int) -> list[str]:
    """The calls :func:`models.lifecycle.expire` would expire now, oldest first (the sweep expires each in its own
    transaction, together with its ``expired`` event)."""
    return list(s.scalars(
        select(ToolCall.tool_call_id).where(stale_where(pending_ttl_s, prepared_ttl_s)).order_by(ToolCall.created_at)
    ))


def quiet_for(older_than_s: int) -> ColumnElement[bool]:
    """The call's latest sign of life is older than ``older_than_s``: the moment a link passed a side
    effect's gate or recorded its step (``step_started_at``), or a confirm, resume or redrive
    after it (GREATEST skips NULLs); never its first link (``executed_at``), so a call whose first
    step ran long ago is not taken for stuck while a later link runs."""
    return (func.greatest(ToolCall.step_started_at, ToolCall.resumed_at, ToolCall.confirmed_at)
            < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_s))


def stuck_executing(s: Session, older_than_s: int) -> list[str]:
    """Calls EXECUTING with no progress for ``older_than_s`` (their worker died)."""
    stmt = select(ToolCall.tool_call_id).where(ToolCall.status == EXECUTING, quiet_for(older_than_s))
    return list(s.scalars(stmt).all())


# -- what operators ask, and the deliveries ---------------------------------------

# Which deliveries an operator may send again: those with a URL that did not get through.
REDELIVERABLE = ("failed", "pending")


def schema_ready(s: Session) -> bool:
    """Has this database been migrated (is there a ``tool_calls`` table)?"""
    return s.scalar(select(func.to_regclass("tool_calls"))) is not None


def list_calls(s: Session, *, statuses: Iterable[str] = (), session_id: str | None = None,
               tool: str | None = None, since: datetime | None = None, limit: int = 50) -> list[ToolCall]:
    """Calls matching every filter given, newest first."""
    stmt = select(ToolCall)
    if statuses:
        stmt = stmt.where(ToolCall.status.in_(tuple(statuses)))
    if session_id:
        stmt = stmt.where(ToolCall.session_id == session_id)
    if tool:
        stmt = stmt.where(ToolCall.function_name == tool)
    if since is not None:
        stmt = stmt.where(ToolCall.created_at >= since)
    return list(s.scalars(stmt.order_by(ToolCall.created_at.desc(), ToolCall.tool_call_id).limit(limit)))


def deliveries(s: Session, tool_call_id: str) -> list[CallbackDelivery]:
    """A call's callback events (every one recorded, with or without a URL), in ``seq`` order."""
    return list(s.scalars(
        select(CallbackDelivery).where(CallbackDelivery.tool_call_id == tool_call_id).order_by(CallbackDelivery.seq)
    ))


def redeliverable(s: Session, *, failed_only: bool = False, tool_call_id: str | None = None,
                  tool_call_ids: list[str] | None = None) -> list[CallbackDelivery]:
    """Deliveries that did not get through: ``failed`` (retries exhausted) and, unless
    ``failed_only``, ``pending`` ones (still retrying), of one call if given (or of these calls); oldest first."""
    stmt = select(CallbackDelivery).where(
        CallbackDelivery.url.is_not(None),
        CallbackDelivery.state.in_(("failed",) if failed_only else REDELIVERABLE),
    )
    if tool_call_id:
        stmt = stmt.where(CallbackDelivery.tool_call_id == tool_call_id)
    if tool_call_ids is not None:
        stmt = stmt.where(CallbackDelivery.tool_call_id.in_(tool_call_ids))
    return list(s.scalars(stmt.order_by(CallbackDelivery.created_at, CallbackDelivery.seq)))


def due_event_ids(s: Session, grace_s: int = 30, limit: int = 500) -> list[str]:
    """Pending deliveries whose post is overdue: one overdue by ``grace_s`` (its retry message was lost), and
    one claimed for a post that was never recorded once the claim's lease has passed (its process died between
    taking the row, or the transition's commit that inserted it claimed for its inline post, and the post: no
    retry message was ever sent for it, so no grace)."""
    due = func.coalesce(CallbackDelivery.next_attempt_at, CallbackDelivery.created_at)
    return list(s.scalars(
        select(CallbackDelivery.event_id).where(
            CallbackDelivery.state == "pending",
            or_(due < func.now() - timedelta(seconds=grace_s),
                and_(CallbackDelivery.attempts == 0, CallbackDelivery.next_attempt_at < func.now())),
        ).limit(limit)
    ).all())


def count_by_tool_and_status(s: Executor, *where: ColumnElement[bool]) -> dict[tuple[str, str], int]:
    """How many calls of each tool are in each status (of those ``where`` selects)."""
    return {(name, status): count for name, status, count in s.execute(
        select(ToolCall.function_name, ToolCall.status, func.count()).where(*where)
        .group_by(ToolCall.function_name, ToolCall.status))}


def stats(s: Session, *, since: datetime | None = None, tool: str | None = None) -> list[dict[str, Any]]:
    """Per tool: calls by status, success rate, p50/p95 ``execution_time_ms``, callback failures.

    ``success_rate`` is COMPLETED / (COMPLETED + FAILED): of the calls that ran to an end,
    the share that succeeded (a cancelled or expired call was the caller's choice, not a
    failure); None while neither happened. The percentiles are over COMPLETED calls.
    ``callbacks_failed`` counts deliveries given up (state ``failed``),
    ``callback_failed_attempts`` every attempt that did not get a 2xx.
    """
    where = []
    if since is not None:
        where.append(ToolCall.created_at >= since)
    if tool:
        where.append(ToolCall.function_name == tool)
    scope = and_(*where) if where else True

    by_tool: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        return by_tool.setdefault(name, {
            "tool": name, "total": 0, "by_status": {status: 0 for status in STATUSES}, "open": 0,
            "success_rate": None, "p50_ms": None, "p95_ms": None,
            "callbacks_failed": 0, "callback_failed_attempts": 0,
        })

    for (name, status), count in count_by_tool_and_status(s, scope).items():
        item = entry(name)
        item["by_status"][status] = count
        item["total"] += count
        if status in OPEN:
            item["open"] += count

    ms = ToolCall.execution_time_ms
    for name, p50, p95 in s.execute(
        select(ToolCall.function_name,
               func.percentile_cont(0.5).within_group(ms), func.percentile_cont(0.95).within_group(ms))
        .where(scope, ToolCall.status == COMPLETED, ms.is_not(None))
        .group_by(ToolCall.function_name)
    ):
        entry(name).update(p50_ms=round(p50), p95_ms=round(p95))

    attempt = func.jsonb_array_elements(CallbackDelivery.attempt_log).table_valued("value").alias("attempt")
    failed_attempts = (
        select(func.count()).select_from(attempt)
        .where(attempt.c.value.op("->>")("error").is_not(None)).scalar_subquery()
    )
    for name, given_up, failed in s.execute(
        select(ToolCall.function_name,
               func.count().filter(CallbackDelivery.state == "failed"),
               func.coalesce(func.sum(cast(failed_attempts, Integer)), 0))
        .join(CallbackDelivery, CallbackDelivery.tool_call_id == ToolCall.tool_call_id)
        .where(scope).group_by(ToolCall.function_name)
    ):
        entry(name).update(callbacks_failed=given_up, callback_failed_attempts=int(failed))

    for item in by_tool.values():
        ended = item["by_status"][COMPLETED] + item["by_status"][FAILED]
        item["success_rate"] = round(item["by_status"][COMPLETED] / ended, 4) if ended else None
    return [by_tool[name] for name in sorted(by_tool)]
