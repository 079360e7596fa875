"""The bare side of the chain benchmark: a plain Celery app whose tasks do what a link observably does, and no more.

``app`` is a plain ``Celery()``: acks late, prefetch 1, no result backend, no task events, none of
the product's settings, signals or base task; its own worker runs it (``celery -A bench.noop
worker``, started as the Procfile's ``reads`` line is: same pool and concurrency; ``bench/stack.py``).
Each link reads its call's status and writes its step in one statement (an ``UPDATE ...
RETURNING status``, durable, autocommit, on the same engine settings), and, given a receiver,
posts one signed event to it (``progress`` from each link but the last, then ``completed`` or
``checkpoint``) over a plain ``requests`` session of its process, so the two sides differ only by
what the engine does in each link beyond that.

``record=True`` makes a second floor, the work every link must do (docs/promises.md,
'Events and their order'), written by hand: read the status; record the link's progress
and insert its event row (with the call's next ``seq``) in one durable statement; post
that row's payload; and record the attempt on the row once the chain's next link is sent.
A chain's ratio to it is what the engine costs beyond that work: its Python, SQLAlchemy
and Celery glue, its step, its metrics, task events and log context.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Callable

import requests
from celery import Celery, Task
from sqlalchemy import bindparam, select, text

from models import db, events, settings
from models.calls import ToolCall
from tasks.delivery.signing import sign

QUEUE = "bench.noop"
app = Celery("bench_noop", broker=os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL"))
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, task_ignore_result=True,
                task_default_queue=QUEUE, broker_connection_retry_on_startup=True)

_STATUS = select(ToolCall.status).where(ToolCall.tool_call_id == bindparam("p_id"))
# the bare link's own work: read the call's status and write its step, in one statement
_STEP = text("UPDATE tool_calls SET current_step = :event, progress = :progress WHERE tool_call_id = :id "
             "RETURNING status")
# the link's progress and its event row, with the call's next seq, in one statement (as lifecycle.record_step)
_RECORD = text("""
WITH moved AS (
    UPDATE tool_calls SET progress = :progress, current_step = :event, event_seq = event_seq + 1
    WHERE tool_call_id = :id AND status = 'EXECUTING'
    RETURNING tool_call_id, session_id, function_name, status, parameters, event_seq)
INSERT INTO callback_deliveries (event_id, tool_call_id, session_id, event, seq, payload, url, state, attempts,
                                 next_attempt_at)
SELECT :event_id, tool_call_id, session_id, :event, event_seq,
       jsonb_build_object('event_id', :event_id, 'type', 'tool_status', 'event', :event,
                          'tool_call_id', tool_call_id, 'session_id', session_id, 'function_name', function_name,
                          'status', status, 'parameters', parameters, 'progress', :progress, 'seq', event_seq),
       :url, CASE WHEN :url IS NULL THEN 'none' ELSE 'pending' END, 0,
       CASE WHEN :url IS NULL THEN NULL ELSE now() + make_interval(secs => :lease_s) END
FROM moved RETURNING payload
""")
_ATTEMPT = text("""
UPDATE callback_deliveries SET state = 'delivered', attempts = attempts + 1, response_code = :code,
       delivered_at = now(), next_attempt_at = NULL,
       attempt_log = attempt_log || jsonb_build_array(jsonb_build_object('at', now(), 'response_code', :code))
WHERE event_id = :event_id AND state = 'pending'
""")


_http: tuple[int, requests.Session] | None = None


def http() -> requests.Session:
    """This process's plain keep-alive session (made again in a forked child)."""
    global _http
    if _http is None or _http[0] != os.getpid():
        session = requests.Session()
        session.trust_env = False
        _http = (os.getpid(), session)
    return _http[1]


class Bare(Task):
    """Runs what a link leaves for later (recording its attempt) once the chain's next link is sent."""

    def after_return(self, *args: Any) -> None:
        for work in getattr(self.request, "bench_after", None) or ():
            work()
        self.request.bench_after = None


@app.task(name="bench.noop", base=Bare, bind=True, queue=QUEUE, ignore_result=True, acks_late=True,
          reject_on_worker_lost=True)
def noop(self: Bare, key: str, receiver_url: str | None = None, event: str = "completed",
         record: bool = False) -> None:
    progress = 1.0 if event != "progress" else 0.5
    event_id = uuid.uuid4().hex
    payload: Any = {"tool_call_id": key, "event": event}
    if not record:
        with db.statement() as conn:
            conn.execute(_STEP, {"id": key, "event": event, "progress": progress}).one_or_none()
    else:  # with no receiver, the event is recorded all the same (as the engine's, for the event stream)
        with db.statement() as conn:
            conn.execute(_STATUS, {"p_id": key}).one_or_none()
        with db.statement() as conn:
            payload = conn.execute(_RECORD, {"id": key, "event": event, "event_id": event_id, "url": receiver_url,
                                             "progress": progress,
                                             "lease_s": events.lease_s(settings.load().callback_timeout)}
                                   ).scalar_one()
    if receiver_url is None:
        return
    body = json.dumps(payload).encode()
    timestamp = str(int(time.time()))
    answer = http().post(receiver_url, data=body, timeout=5, headers={
        "Content-Type": "application/json",
        "X-Voice-Tools-Timestamp": timestamp,
        "X-Voice-Tools-Signature": sign(settings.load().callback_secret, timestamp, body),
    })
    answer.raise_for_status()
    if record:
        self.request.bench_after = [_recorder(event_id, answer.status_code)]


def _recorder(event_id: str, code: int) -> Callable[[], None]:
    def record_attempt() -> None:
        with db.statement() as conn:
            conn.execute(_ATTEMPT, {"event_id": event_id, "code": code})

    return record_attempt


def chain_of(key: str, links: int, receiver_url: str | None, until: str = "completed", record: bool = False) -> object:
    """A bare chain of ``links`` links for ``key``: each posts ``progress``, the last ``until``."""
    from celery import chain

    return chain(*[noop.si(key, receiver_url, "progress", record) for _ in range(links - 1)],
                 noop.si(key, receiver_url, until, record))
