"""Beat sweeps on the ``maintenance`` queue: each task one line over ``tasks.calls.maintenance``.

Each sweep is a task of the one base class (``tasks/base.py``: timed and counted), but
is not retried when the database is away: beat runs it again on its schedule. Each
returns how many calls (or rows) it handled.
"""
from __future__ import annotations

import functools

from tasks.calls import maintenance
from tasks.celery_app import app

sweep = functools.partial(app.task, ignore_result=True, autoretry_for=())


@sweep(name="maintenance.expire_stale")
def expire_stale() -> int:
    """PENDING and PREPARED calls left unanswered past their TTL become EXPIRED."""
    return maintenance.expire_stale()


@sweep(name="maintenance.fail_stuck")
def fail_stuck() -> int:
    """Calls EXECUTING whose chain was lost are failed, or run again past their point of no return."""
    return maintenance.fail_stuck()


@sweep(name="maintenance.retry_callbacks")
def retry_callbacks() -> int:
    """Re-enqueue deliveries whose retry is overdue (their message was lost)."""
    return maintenance.retry_callbacks()


@sweep(name="maintenance.purge_context")
def purge_context() -> int:
    """Delete expired session context."""
    return maintenance.purge_context()
