"""Each beat sweep runs once per period, however many beats send it (``sweep_runs``, migration 0014).

Every beat sends every sweep on its own clock; each send carries the sweep's period and the time
it was sent (``celeryconfig.beat_schedule``). The send's period is its time floored to a multiple
of the period (the same on every host whose clock is kept, as NTP keeps it); the first run of the
period's sends inserts the sweep's row for it and works, any other finds the row and does nothing.
So with two beats a sweep works once in each period, and with one beat gone the other's next
send, within one period, works. A beat sends a sweep at most once a period, so one beat alone
works every send; periods are taken by the send's time, not by the run's, so a run that waits
in the queue does not take the next period's place.

Why the database rather than a lock in the broker (``celery-redbeat``) or a leader beat: it is
the store every worker already uses and the one that holds the facts the sweeps act on; the
claim is one indexed ``INSERT … ON CONFLICT DO NOTHING``, with no lease to renew or expire, and
no beat holds any state of its own (their schedules are in memory: no file on a disk).
"""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import text
from sqlalchemy.orm import Session

# how long a sweep's past periods are kept (they are read by operators, not by the claim)
KEPT_S = 86400

_CLAIM = text("""
INSERT INTO sweep_runs (sweep, period_start, claimed_by)
VALUES (:sweep, to_timestamp(floor(coalesce(CAST(:at AS double precision), extract(epoch FROM now()))
                                    / CAST(:every AS double precision)) * CAST(:every AS double precision)), :by)
ON CONFLICT DO NOTHING
RETURNING period_start
""")

_PRUNE = text("DELETE FROM sweep_runs WHERE sweep = :sweep AND period_start < :started - make_interval(secs => :kept)")


def claim(s: Session, sweep: str, every_s: float, at: float | None = None, by: str | None = None) -> datetime | None:
    """Take for this run ``sweep``'s period (``every_s`` long) of the moment ``at`` (seconds since
    the epoch: when beat sent it; None: the database's now): the period's start, or None when
    another run has it already. A claim prunes the sweep's periods older than ``KEPT_S`` (or ten
    periods, if longer) before its own."""
    started = s.execute(_CLAIM, {"sweep": sweep, "every": float(every_s), "at": None if at is None else float(at),
                                 "by": by}).scalar_one_or_none()
    if started is not None:
        s.execute(_PRUNE, {"sweep": sweep, "started": started, "kept": max(KEPT_S, 10 * float(every_s))})
    return started
