"""The delivered attempts of a process's links, recorded in batches by one thread, off the links' clock.

Every attempt to post an event is recorded on its row (``tasks/delivery/attempts.py``). A link
posts its event inline; recording that attempt with a statement of its own cost the pool child a
round trip and a durable commit a link, after its chain's next link was sent, while that next link
ran beside it on the same cores. A delivered attempt of a link is handed here instead: one thread
of the process (made again in a forked child; ``tasks/worker/lingering.py``) waits :data:`LINGER_S`
after an attempt arrives, so that the attempts of the next moments (a chain's next links, other
chains' links) join it, and records them all with one statement.

What a delivered attempt records is known when it is handed over: ``delivered``, its response
code and its time (``delivered_at`` is the attempt's, not the batch's). A failed attempt, and an
answer asking to cancel, are recorded by the link itself at once: a retry is scheduled from the
row, and a cancel acts on it.

Until its batch is recorded the row stays ``pending``, due again when the lease the link's post
took ends (``models/events.py``, ``lease_s``). So if the process dies first (a pool child killed,
the database away for longer than the thread's tries), the retry sweep posts the event again,
with the same ``event_id`` (the relay drops the duplicate), and that attempt is recorded. A worker
that stops cleanly records what it holds first (:func:`drain`: a pool child on
``worker_process_shutdown``; a worker running its links in its own process, ``--pool solo`` or
``threads``, on ``worker_shutdown``).
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any

from celery.signals import worker_process_shutdown, worker_shutdown
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB

from models import db
from models.compiled import Compiled
from tasks.worker.lingering import LingeringThread, per_process

log = logging.getLogger(__name__)

LINGER_S = 0.05  # how long the first attempt of a batch waits for others to join it
BATCH = 500  # attempts recorded by one statement at most
TRIES = 3  # a batch the database refuses is tried again, RETRY_S apart, then left to the retry sweep
RETRY_S = 1.0
DRAIN_S = 5.0  # how long a stopping process waits for its attempts to be recorded

# one statement for a batch: each row still pending takes its delivered attempt
_RECORD = Compiled(text("""
UPDATE callback_deliveries AS d
SET state = 'delivered', attempts = d.attempts + 1, response_code = v.code, last_error = NULL,
    next_attempt_at = NULL, delivered_at = v.at,
    attempt_log = d.attempt_log || jsonb_build_array(v.entry)
FROM jsonb_to_recordset(:batch) AS v(event_id text, code integer, at timestamptz, entry jsonb)
WHERE d.event_id = v.event_id AND d.state = 'pending'
""").bindparams(bindparam("batch", type_=JSONB)))


class _Recorder(LingeringThread):
    """The process's recording thread: takes attempts from :meth:`put`, records them in batches."""

    def __init__(self) -> None:
        super().__init__("delivered-attempts", LINGER_S, BATCH)

    def handle(self, batch: list[dict[str, Any]]) -> None:
        for attempt in range(1, TRIES + 1):
            try:
                with db.statement() as s:  # one statement, its own transaction
                    _RECORD.execute(s, {"batch": batch})
                return
            except Exception as exc:  # the database is away: its rows stay pending, for the retry sweep
                if attempt == TRIES:
                    log.warning("%d delivered attempts not recorded (the retry sweep posts them again): %s",
                                len(batch), exc)
                    return
                time.sleep(RETRY_S)


# this process's recording thread (started at its first attempt; a forked child starts its own)
recorder = per_process(_Recorder)


def attempt(event_id: str, code: int | None, note: str | None, took_s: float | None = None) -> dict[str, Any]:
    """A delivered attempt of ``event_id`` made just now, answered with ``code`` after ``took_s``, as the batch
    carries it."""
    at = datetime.now(timezone.utc).isoformat()
    entry: dict[str, Any] = {"at": at, "response_code": code, "error": None}
    if took_s is not None:
        entry["took_ms"] = round(took_s * 1000, 1)
    if note:
        entry["note"] = note
    return {"event_id": event_id, "code": code, "at": at, "entry": entry}


def record(event_id: str, code: int | None, note: str | None = None, took_s: float | None = None) -> None:
    """Hand over a delivered attempt of ``event_id`` (answered with ``code`` after ``took_s``), made just now."""
    recorder().put(attempt(event_id, code, note, took_s))


def drain(timeout: float = DRAIN_S) -> bool:
    """Record what this process has handed over (a process about to stop; a test that reads the rows)."""
    found = recorder.here()
    return True if found is None else found.drain(timeout)


@worker_process_shutdown.connect  # a pool child
@worker_shutdown.connect  # the worker's own process: it ran the links of a solo or threads pool
def _drain_before_exit(**_: Any) -> None:
    drain()
