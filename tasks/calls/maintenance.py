"""What beat's sweeps do (``tasks.sweeps``): expire unanswered calls, deal with calls whose chain
was lost, send overdue callbacks again, purge expired session context, remove what is past its
retention; each returns how many. :func:`claim_period` lets one run of a sweep per period work,
however many beats send it."""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from sqlalchemy.orm import Session

from models import db, queries, retention, settings, sweep_runs
from tasks import chains, liveness
from tasks.calls import actions
from tasks.celery_app import app
from tasks.delivery import attempts
from tasks.worker import metrics

log = logging.getLogger(__name__)

STOPPED = "The worker stopped before finishing."


def expire_stale() -> int:
    """PENDING and PREPARED calls left unanswered past their TTL become EXPIRED, each in its own
    transaction with its ``expired`` event; a call that cannot be expired is left as it was
    (logged; the next sweep tries again) and the rest of the batch goes on."""
    cfg = settings.load()
    with db.session() as s:
        stale = queries.stale(s, pending_ttl_s=cfg.pending_ttl_s, prepared_ttl_s=cfg.prepared_ttl_s)
    expired = 0
    for tool_call_id in stale:
        try:
            expired += actions.expire(tool_call_id, cfg.pending_ttl_s, cfg.prepared_ttl_s) is not None
        except Exception:
            log.exception("could not expire %s; left as it was for the next sweep", tool_call_id)
    return expired


def fail_stuck() -> int:
    """Calls EXECUTING whose chain was lost (judged by the facts the broker and the workers give,
    ``tasks/liveness.py``: no link of theirs waiting, delivered or running anywhere, and quiet
    past their links' time limit; where the facts cannot tell, quiet past
    ``VOICE_TOOLS_STUCK_EXECUTING_AFTER``): fail those that never reached the point of no return;
    run the rest of the chain again for those that did (their side effect is idempotent), at
    most ``VOICE_TOOLS_MAX_REDRIVES`` times, then fail them saying the outcome is unconfirmed. A
    call waiting in a backlog, or whose link runs, is left alone."""
    cfg = settings.load()
    handled = 0
    for found in liveness.stuck(app, cfg.stuck_executing_s):
        call, tool, quiet_s = found.call, found.tool, found.quiet_s
        if call.committed_at is not None:
            done = actions.redrive(tool, call.tool_call_id, quiet_s, cfg.max_redrives)
            if done is not None:
                metrics.redriven(tool.name)
            done = done or actions.give_up(tool, call.tool_call_id, call.parameters, quiet_s, cfg.max_redrives)
        else:  # only if it is still where the facts saw it (uncommitted, at the same step, quiet)
            done = chains.fail_call(tool, call.tool_call_id, STOPPED, call.parameters,
                                    step=call.current_step, uncommitted_only=True, only_at_step=True,
                                    quiet_s=quiet_s)
        handled += done is not None
    return handled


def retry_callbacks() -> int:
    """Send again, from the callbacks queue, the deliveries whose retry is overdue (their message was lost)."""
    with db.session() as s:
        due = queries.due_event_ids(s)
    for event_id in due:
        attempts.dispatch(event_id)
    return len(due)


def purge_context(batch: int | None = None) -> int:
    """Delete the session context past its expiry, ``batch`` rows per transaction."""
    batch = batch or settings.load().purge_batch
    removed = 0
    while True:
        with db.session() as s:
            done = retention.purge_context(s, batch)
        removed += done
        if done < batch:
            return removed


def claim_period(sweep: str, every_s: float, at: float | None = None, by: str | None = None) -> datetime | None:
    """Take for this run ``sweep``'s period of the moment ``at`` (when beat sent it; None: now),
    ``models/sweep_runs.py``: the period's start, or None when a run sent by another beat has it."""
    by = by or f"{socket.gethostname()}:{os.getpid()}"
    with db.session() as s:
        return sweep_runs.claim(s, sweep, every_s, at=at, by=by[:200])


# a retention sweep stops starting batches after this many seconds (below the tasks' soft
# time limit); the next sweep goes on where it stopped
PURGE_BUDGET_S = 60.0


@dataclass
class Purged:
    """What a purge removed (or, dry, would remove): ended calls, events (theirs and those
    removed on their own), expired session context; ``batches`` transactions; ``done`` False
    when it stopped at its time budget with more to remove."""

    calls: int = 0
    events: int = 0
    context: int = 0
    batches: int = 0
    done: bool = True
    retained: dict[str, float | None] = field(default_factory=dict)


def purge(*, calls_s: float | None = None, events_s: float | None = None, batch: int | None = None,
          budget_s: float | None = None, dry_run: bool = False, pause: float | None = None) -> Purged:
    """Remove what is past its retention, ``batch`` rows per transaction (``models/retention.py``):
    ended calls older than ``calls_s`` seconds with their events, settled events of ended calls
    older than ``events_s``, and expired session context. Each retention defaults to its setting
    (``VOICE_TOOLS_RETAIN_*_DAYS``); 0 keeps that table's rows forever. Never an open call, never
    a pending event. ``dry_run``: count, remove nothing. ``budget_s``: start no batch after so
    many seconds (``done`` False then). After each batch it pauses ``pause`` times as long as the
    batch took (``VOICE_TOOLS_PURGE_PAUSE``, 3: the purge holds the database at most a quarter
    of the time, and the API's reads keep their pace)."""
    cfg = settings.load()
    calls_s = cfg.retain_calls_s if calls_s is None else calls_s
    events_s = cfg.retain_events_s if events_s is None else events_s
    batch = batch or cfg.purge_batch
    pause = cfg.purge_pause if pause is None else pause
    keep_calls, keep_events = calls_s <= 0, events_s <= 0
    out = Purged(retained={"calls_s": None if keep_calls else calls_s, "events_s": None if keep_events else events_s})
    if dry_run:
        with db.session() as s:
            if not keep_calls:
                out.calls, out.events = retention.count_calls(s, calls_s)
            if not keep_events:
                out.events += retention.count_events(s, events_s, None if keep_calls else calls_s)
            out.context = retention.count_context(s)
        return out
    deadline = None if budget_s is None else time.monotonic() + budget_s
    last_batch_s = 0.0

    def more_time() -> bool:
        if last_batch_s and pause:
            time.sleep(last_batch_s * pause)
        if deadline is not None and time.monotonic() >= deadline:
            out.done = False
            return False
        return True

    def timed(one_batch: Callable[[Session], Any]) -> Any:
        nonlocal last_batch_s
        started = time.monotonic()
        with db.session() as s:
            done = one_batch(s)
        out.batches += 1
        last_batch_s = time.monotonic() - started
        return done

    while not keep_calls and more_time():
        calls, events, picked = timed(lambda s: retention.purge_calls(s, calls_s, batch))
        out.calls, out.events = out.calls + calls, out.events + events
        if picked < batch:
            break
    while not keep_events and more_time():
        events = timed(lambda s: retention.purge_events(s, events_s, batch))
        out.events += events
        if events < batch:
            break
    while more_time():
        context = timed(lambda s: retention.purge_context(s, batch))
        out.context += context
        if context < batch:
            break
    if not out.done:
        log.info("retention purge stopped at its %ss budget; the next sweep goes on", budget_s)
    return out
