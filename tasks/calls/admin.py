"""What an operator asks of the calls from the command line (``celery -A tasks calls|callbacks``):
list, show, count, purge what is past its retention, redeliver callbacks; a cancel is the operation every face shares
(``tasks.calls.operations.cancel``). An operator is unscoped: every caller's calls."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable

from sqlalchemy.orm import Session

from models import db, lifecycle, queries
from models.calls import CallbackDelivery, ToolCall
from tasks.calls import maintenance
from tasks.delivery import attempts


@dataclass(frozen=True)
class Shown:
    """One call and every callback event recorded for it, in ``seq`` order."""

    call: ToolCall
    deliveries: list[CallbackDelivery]


def tables_ready() -> bool:
    """Is the database migrated (does it have our tables)? Raises if it cannot be reached."""
    with db.session() as s:
        return queries.schema_ready(s)


def list_calls(*, statuses: Iterable[str] = (), session_id: str | None = None, tool: str | None = None,
               since: datetime | None = None, limit: int = 50) -> list[ToolCall]:
    """The calls matching every filter given, newest first."""
    with db.session() as s:
        return queries.list_calls(s, statuses=statuses, session_id=session_id, tool=tool, since=since, limit=limit)


def show(tool_call_id: str) -> Shown:
    """A call and its callback events; :class:`models.queries.NotFound` for an unknown id."""
    with db.session() as s:
        call = queries.get(s, tool_call_id)
        return Shown(call, queries.deliveries(s, tool_call_id))


def stats(*, since: datetime | None = None, tool: str | None = None) -> list[dict[str, Any]]:
    """Per tool: calls by status, success rate, p50/p95 execution time, callback failures."""
    with db.session() as s:
        return queries.stats(s, since=since, tool=tool)


def redeliver(*, failed_only: bool = False, tool_call_id: str | None = None,
              event_ids: Iterable[str] | None = None, acted: lifecycle.Acted | None = None) -> list[CallbackDelivery]:
    """Send undelivered callbacks again from the callbacks queue: every failed one (``failed_only``),
    or one call's failed or still-retrying ones, or that call's failed ones (both), only those of
    ``event_ids`` when given; the deliveries queued, as they were before. Each call whose events are
    sent again says so in its history, with who asked through which face (``acted``), in the same
    transaction. :class:`models.queries.NotFound` for an unknown call."""
    with db.session() as s:
        if tool_call_id is not None:
            queries.get(s, tool_call_id)
        chosen = queries.redeliverable(s, failed_only=failed_only, tool_call_id=tool_call_id)
        if event_ids is not None:
            wanted = set(event_ids)
            chosen = [d for d in chosen if d.event_id in wanted]
        return _taken_again(s, chosen, acted)


def redeliver_calls(tool_call_ids: list[str], acted: lifecycle.Acted | None = None) -> dict[str, int]:
    """Send the failed callbacks of these calls again (a bulk redelivery's batch: one transaction), each
    call's history saying so (``acted``); how many events of each call were queued."""
    with db.session() as s:
        chosen = queries.redeliverable(s, failed_only=True, tool_call_ids=tool_call_ids)
        queued = _taken_again(s, chosen, acted)
    counts = dict.fromkeys(tool_call_ids, 0)
    for delivery in queued:
        counts[delivery.tool_call_id] += 1
    return counts


def _taken_again(s: Session, chosen: list[CallbackDelivery], acted: lifecycle.Acted | None) -> list[CallbackDelivery]:
    """Take ``chosen`` again (``attempts.take_again``) and note it on each call; each is sent after the commit."""
    taken = set(attempts.take_again(s, [d.event_id for d in chosen]))
    queued = [d for d in chosen if d.event_id in taken]
    by_call: dict[str, list[tuple[int, str, str]]] = {}
    for d in queued:
        by_call.setdefault(d.tool_call_id, []).append((d.seq, d.event, d.event_id))
    for call_id, events in by_call.items():
        lifecycle.note_redelivered(s, call_id, events, acted)
    for d in queued:  # sent once taken and noted
        db.after_commit(s, attempts.dispatch, d.event_id)
    return queued


def purge(*, older_than_s: float | None = None, dry_run: bool = False, batch: int | None = None) -> maintenance.Purged:
    """Remove (``dry_run``: count) ended calls with their events and settled events older than
    ``older_than_s`` (default: each table's retention), and expired context, in batches, to the end."""
    return maintenance.purge(calls_s=older_than_s, events_s=older_than_s, batch=batch, dry_run=dry_run)
