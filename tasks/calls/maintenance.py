"""What beat's sweeps do (``tasks.sweeps``): expire unanswered calls, deal with calls whose chain
was lost, send overdue callbacks again, purge expired session context; each returns how many."""
from __future__ import annotations

import logging

from models import db, queries, session_context, settings
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


def purge_context() -> int:
    """Delete the session context past its expiry."""
    with db.session() as s:
        return session_context.purge_expired_context(s)
