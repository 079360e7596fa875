"""Beat sweeps on the ``maintenance`` queue: each task one line over ``tasks.calls.maintenance``.

Each sweep is a task of the one base class (``tasks/base.py``: timed and counted), but
is not retried when the database is away: beat runs it again on its schedule. Each
returns how many calls (or rows) it handled.

Any number of beats may run (one per worker host, say): beat's schedule
(``celeryconfig.beat_schedule``) sends each sweep with its period, ``every``, and the time it was
sent, ``sent_at``; a run sent so works only if it takes that moment's period of the sweep in the
database (``maintenance.claim_period``, ``models/sweep_runs.py``); another run of the same
period returns None at once. A sweep sent without ``every`` (an operator's ``apply_async``, a
test) always works.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

from celery import current_task

from tasks.calls import maintenance
from tasks.celery_app import app

log = logging.getLogger(__name__)

sweep = functools.partial(app.task, ignore_result=True, autoretry_for=())


def _once_per_period(name: str, every: float | None, sent_at: float | None, work: Callable[[], Any]) -> Any:
    """``work()`` if this run takes ``name``'s period (``every`` seconds) of ``sent_at``, or no period is given."""
    if every is not None:
        request = getattr(current_task, "request", None)
        by = getattr(request, "hostname", None)
        if maintenance.claim_period(name, every, at=sent_at, by=by and f"{by}:{os.getpid()}") is None:
            log.info("%s: this period's run is another's; nothing to do", name)
            return None
    return work()


@sweep(name="maintenance.expire_stale")
def expire_stale(every: float | None = None, sent_at: float | None = None) -> int | None:
    """PENDING and PREPARED calls left unanswered past their TTL become EXPIRED."""
    return _once_per_period("maintenance.expire_stale", every, sent_at, maintenance.expire_stale)


@sweep(name="maintenance.fail_stuck")
def fail_stuck(every: float | None = None, sent_at: float | None = None) -> int | None:
    """Calls EXECUTING whose chain was lost are failed, or run again past their point of no return."""
    return _once_per_period("maintenance.fail_stuck", every, sent_at, maintenance.fail_stuck)


@sweep(name="maintenance.retry_callbacks")
def retry_callbacks(every: float | None = None, sent_at: float | None = None) -> int | None:
    """Re-enqueue deliveries whose retry is overdue (their message was lost)."""
    return _once_per_period("maintenance.retry_callbacks", every, sent_at, maintenance.retry_callbacks)


@sweep(name="maintenance.purge_context")
def purge_context(every: float | None = None, sent_at: float | None = None) -> int | None:
    """Delete expired session context (in batches)."""
    return _once_per_period("maintenance.purge_context", every, sent_at, maintenance.purge_context)


@sweep(name="maintenance.purge_old")
def purge_old(every: float | None = None, sent_at: float | None = None) -> int | None:
    """Remove ended calls, their events and settled events past their retention, and expired
    context, in batches, for at most ``maintenance.PURGE_BUDGET_S``; how many rows."""
    def work() -> int:
        out = maintenance.purge(budget_s=maintenance.PURGE_BUDGET_S)
        log.info("retention purge: %d calls, %d events, %d context values in %d batches%s", out.calls,
                 out.events, out.context, out.batches, "" if out.done else " (more left for the next sweep)")
        return out.calls + out.events + out.context
    return _once_per_period("maintenance.purge_old", every, sent_at, work)
