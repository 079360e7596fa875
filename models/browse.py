"""What the console reads: a page of calls newest first (by keyset, never OFFSET), the calls a live
list must redraw, and each tool's figures over the last hour.

The list is ordered by ``(created_at, tool_call_id)`` descending and continued after the last
row shown, so every page is one index range (migration 0021: every call, a caller's own, one
tool's; a session's by ``idx_tool_calls_session``) however many calls the table holds.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable

from sqlalchemy import Row, Select, and_, exists, func, literal, select, text, tuple_

from models.calls import FAILED, CallbackDelivery, ToolCall

# the columns of a row of the list
LIST_COLUMNS = (ToolCall.tool_call_id, ToolCall.function_name, ToolCall.status, ToolCall.session_id,
                ToolCall.caller, ToolCall.created_at, ToolCall.completed_at)
MAX_PAGE = 200
HOUR_S = 3600
MAX_COUNTED = 10_000  # the counts by status read at most this many calls (the newest), and say when more match


def calls_page(s: Any, **filters: Any) -> list[Row[Any]]:
    """Up to ``limit`` calls matching every filter, newest first (:func:`page_statement`)."""
    return list(s.execute(page_statement(**filters)))


def page_statement(*, scope: str | None, statuses: Iterable[str] = (), tool: str | None = None,
                   session_id: str | None = None, caller: str | None = None, tool_call_id: str | None = None,
                   created_from: datetime | None = None, created_to: datetime | None = None,
                   before: tuple[datetime, str] | None = None, limit: int = 50) -> Select[Any]:
    """Up to ``limit`` calls matching every filter, newest first, after ``before`` (the
    ``(created_at, tool_call_id)`` of the last row of the previous page); only ``scope``'s calls when
    it is given (None: an admin's, everyone's); recorded from ``created_from`` (included) to
    ``created_to`` (excluded) when given: a range of the same index."""
    where = _where(scope, statuses, tool, session_id, caller, tool_call_id, created_from, created_to)
    if before is not None:
        where.append(tuple_(ToolCall.created_at, ToolCall.tool_call_id) < tuple_(*before))
    return (select(*LIST_COLUMNS).where(and_(True, *where))
            .order_by(ToolCall.created_at.desc(), ToolCall.tool_call_id.desc()).limit(min(limit, MAX_PAGE)))


def counts_statement(*, scope: str | None, tool: str | None = None, session_id: str | None = None,
                     caller: str | None = None, tool_call_id: str | None = None,
                     created_from: datetime | None = None, created_to: datetime | None = None) -> Select[Any]:
    """How many of the newest ``MAX_COUNTED + 1`` calls matching every filter (but the statuses) are in
    each status: one range of the list's index, bounded, however many calls the table holds (more than
    ``MAX_COUNTED`` in all: the counts are of the newest only, and the caller says so)."""
    where = _where(scope, (), tool, session_id, caller, tool_call_id, created_from, created_to)
    newest = (select(ToolCall.status).where(and_(True, *where))
              .order_by(ToolCall.created_at.desc(), ToolCall.tool_call_id.desc()).limit(MAX_COUNTED + 1)
              .subquery("newest"))
    return select(newest.c.status, func.count()).group_by(newest.c.status)


def _where(scope: str | None, statuses: Iterable[str], tool: str | None, session_id: str | None,
           caller: str | None, tool_call_id: str | None, created_from: datetime | None,
           created_to: datetime | None) -> list[Any]:
    where = []
    if scope is not None:
        where.append(ToolCall.caller == scope)
    if caller:
        where.append(ToolCall.caller == caller)
    statuses = tuple(statuses)
    if statuses:
        where.append(ToolCall.status.in_(statuses))
    if tool:
        where.append(ToolCall.function_name == tool)
    if session_id:
        where.append(ToolCall.session_id == session_id)
    if tool_call_id:
        where.append(ToolCall.tool_call_id == tool_call_id)
    if created_from is not None:
        where.append(ToolCall.created_at >= created_from)
    if created_to is not None:
        where.append(ToolCall.created_at < created_to)
    return where


Keyset = tuple[datetime, str]  # a call's place in the list: (created_at, tool_call_id)


def _chosen_where(scope: str | None, statuses: Iterable[str], filters: dict[str, Any], until: Keyset | None,
                  after: Keyset | None, failed_delivery: bool) -> list[Any]:
    named = ("tool", "session_id", "caller", "tool_call_id", "created_from", "created_to")
    where = _where(scope, statuses, *(filters.get(name) for name in named))
    key = tuple_(ToolCall.created_at, ToolCall.tool_call_id)
    if until is not None:
        where.append(key <= tuple_(*until))
    if after is not None:
        where.append(key < tuple_(*after))
    if failed_delivery:
        where.append(exists().where(CallbackDelivery.tool_call_id == ToolCall.tool_call_id,
                                    CallbackDelivery.state == "failed", CallbackDelivery.url.is_not(None)))
    return where


def chosen_batch(*, scope: str | None, statuses: Iterable[str], filters: dict[str, Any], until: Keyset | None,
                 after: Keyset | None = None, failed_delivery: bool = False, limit: int) -> Select[Any]:
    """The next ``limit`` calls an action on many takes, newest first: those matching the list's filters
    (``filters``: ``_where``'s), no newer than ``until`` (the newest when they were counted: a call
    recorded since is not taken), older than ``after`` (the last of the previous batch), with a failed
    delivery that has a URL when ``failed_delivery``: a range of the list's index, as a page is."""
    where = _chosen_where(scope, statuses, filters, until, after, failed_delivery)
    return (select(ToolCall.tool_call_id, ToolCall.created_at).where(and_(True, *where))
            .order_by(ToolCall.created_at.desc(), ToolCall.tool_call_id.desc()).limit(limit))


def chosen_count(*, scope: str | None, statuses: Iterable[str], filters: dict[str, Any], until: Keyset | None,
                 failed_delivery: bool = False, at_most: int) -> Select[Any]:
    """How many calls :func:`chosen_batch` walks through in all, counted to ``at_most + 1`` at most (more:
    too many): one bounded range of the list's index."""
    where = _chosen_where(scope, statuses, filters, until, None, failed_delivery)
    chosen = (select(literal(1)).where(and_(True, *where))
              .order_by(ToolCall.created_at.desc(), ToolCall.tool_call_id.desc()).limit(at_most + 1).subquery())
    return select(func.count()).select_from(chosen)


def calls_by_id(s: Any, tool_call_ids: Iterable[str], scope: str | None) -> list[Row[Any]]:
    """The list's rows of these calls (only ``scope``'s when given), with their progress."""
    ids = list(tool_call_ids)
    if not ids:
        return []
    stmt = select(*LIST_COLUMNS, ToolCall.progress, ToolCall.current_step).where(ToolCall.tool_call_id.in_(ids))
    if scope is not None:
        stmt = stmt.where(ToolCall.caller == scope)
    return list(s.execute(stmt))


_PER_MINUTE = text(f"""
    SELECT function_name, floor(extract(epoch FROM now() - created_at) / 60)::int AS minutes_ago, count(*) AS calls,
           count(*) FILTER (WHERE status = '{FAILED}') AS failed
    FROM tool_calls WHERE created_at >= now() - make_interval(secs => {HOUR_S})
    GROUP BY 1, 2
""")

# each run of each step, as its link recorded it on its call (migration 0022), in the order the steps run
_STEP_RUNS = text(f"""
    SELECT t.function_name, a->>'step' AS step, array_agg((a->>'took_ms')::text ORDER BY a->>'started_at') AS took_ms
    FROM tool_calls t CROSS JOIN LATERAL jsonb_array_elements(t.link_attempts) a
    WHERE t.created_at >= now() - make_interval(secs => {HOUR_S}) AND t.link_attempts <> '[]'::jsonb
    GROUP BY 1, 2 ORDER BY 1, min(a->>'started_at')
""")

_CALLBACKS_FAILED = text(f"""
    SELECT t.function_name, count(*) FROM tool_calls t
    JOIN callback_deliveries d ON d.tool_call_id = t.tool_call_id
    WHERE t.created_at >= now() - make_interval(secs => {HOUR_S}) AND d.state = 'failed'
    GROUP BY 1
""")


def hour_figures(s: Any) -> dict[str, dict[str, Any]]:
    """Per tool over the last hour: calls and failures per minute (index 0: this minute), the time
    each run of each step took (ms, as its link recorded it), callbacks given up."""
    figures: dict[str, dict[str, Any]] = {}

    def entry(tool: str) -> dict[str, Any]:
        return figures.setdefault(tool, {"per_minute": [0] * 60, "failed_per_minute": [0] * 60, "steps": [],
                                         "callbacks_failed": 0})

    for tool, minutes_ago, calls, failed in s.execute(_PER_MINUTE):
        if 0 <= minutes_ago < 60:
            entry(tool)["per_minute"][minutes_ago] = calls
            entry(tool)["failed_per_minute"][minutes_ago] = failed
    for tool, step, took_ms in s.execute(_STEP_RUNS):
        entry(tool)["steps"].append({"step": step, "took_ms": [float(ms) for ms in took_ms]})
    for tool, count in s.execute(_CALLBACKS_FAILED):
        entry(tool)["callbacks_failed"] = count
    return figures


def open_counts(s: Any) -> dict[tuple[str, str], int]:
    """How many calls of each tool are open now, by status (the partial index of open calls)."""
    stmt = (select(ToolCall.function_name, ToolCall.status, func.count())
            .where(ToolCall.status.in_(("PENDING", "PREPARED", "EXECUTING"))).group_by(ToolCall.function_name,
                                                                                      ToolCall.status))
    return {(tool, status): count for tool, status, count in s.execute(stmt)}
