"""Delivering callback events: one attempt, the inline post, retries,
an operator's redelivery and the due events the sweep sends again.

A link delivers its event inline with a short timeout; a failed attempt is retried on the
``callbacks`` queue with exponential backoff, and every attempt is recorded on the row.
Before each attempt the URL is checked again (``tasks/delivery/url_policy.py``); the exchange
is ``tasks/delivery/transport.py``'s, the signatures ``tasks/delivery/signing.py``'s (the older
``X-Voice-Tools-*`` headers always, the Standard Webhooks ``webhook-*`` ones with
``VOICE_TOOLS_CALLBACK_SECRETS``).

The relay's answer is read, and a ``{"cancel": true}`` to a cancellable event acted on, by
``tasks/delivery/answers.py``, whichever attempt it answers (inline or a retry).
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable
from urllib.parse import urlsplit

from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError
from sqlalchemy import bindparam, case, func, or_, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session
from sqlalchemy.types import Boolean, DateTime, Integer, String, Text

from models import db, events, settings
from models.calls import CallbackDelivery
from models.compiled import Compiled
from tasks.worker import metrics
from tasks.delivery import answers
from tasks.delivery import delivered as delivered_attempts
from tasks.delivery.signing import sign, sign_standard
from tasks.delivery.url_policy import delivery_route
from tasks.celery_app import app

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    delivered: bool
    cancel: bool = False
    reason: str | None = None
    attempted: bool = True  # False: not due, in flight elsewhere, or no longer pending
    state: str | None = None  # the row's state after this attempt, when recorded by it (delivered, pending, failed)


class DeliveryFailed(Exception):
    """The attempt that gave a delivery up (``failed``: its last attempt, or a final refusal): the
    ``callbacks.deliver`` task fails with it, so its state (what Flower shows) says the delivery failed."""


# A retry message fires at its ETA by the worker's clock; allow for the database's
# (less than the shortest backoff, so a duplicate right after an attempt is not due).
CLOCK_SKEW = timedelta(seconds=0.5)


def backoff_s(attempts: int) -> float:
    """1, 2, 4, ... seconds (capped at 5 minutes), with jitter."""
    return min(2 ** max(attempts - 1, 0), 300) * (0.75 + random.random() / 2)


def _claim(event_id: str, lease_s: float) -> CallbackDelivery | None:
    """Take the row for one attempt if it is pending and due; None if it is not.

    The claim moves ``next_attempt_at`` past the attempt, so a duplicate retry
    message (the sweep re-dispatched it, a worker redelivered it) neither posts the
    event a second time at once nor schedules a second line of retries.
    """
    with db.session() as s:
        return s.scalars(
            update(CallbackDelivery)
            .where(
                CallbackDelivery.event_id == event_id,
                CallbackDelivery.state == "pending",
                or_(CallbackDelivery.next_attempt_at.is_(None),
                    CallbackDelivery.next_attempt_at <= func.now() + CLOCK_SKEW),
            )
            .values(next_attempt_at=func.now() + timedelta(seconds=lease_s))
            .returning(CallbackDelivery)
            .execution_options(synchronize_session=False)
        ).one_or_none()


def attempt(event_id: str, timeout: float | None = None) -> Answer:
    """Post the event once, if it is due, and record the attempt on its row."""
    timeout = timeout or settings.load().callback_timeout
    delivery = _claim(event_id, lease_s=events.lease_s(timeout))
    if delivery is None:
        with db.session() as s:
            state = s.scalar(select(CallbackDelivery.state).where(CallbackDelivery.event_id == event_id))
        return Answer(delivered=state == "delivered", attempted=False)
    return _post(delivery, timeout)


Later = Callable[[Callable[[], None]], None]


def _post(delivery: CallbackDelivery, timeout: float | None, later: Later | None = None) -> Answer:
    """Post a claimed delivery, record the attempt, act on the relay's answer.

    ``later``: where to leave the recording of the attempt to be run once the caller's
    work is done (a link: after its chain's next link is sent), so the caller does not
    wait for it; there a delivered attempt is handed to the process's recording thread
    (``tasks/delivery/delivered.py``: recorded with the others of the moment by one
    statement). An answer asking to cancel is recorded at once, before the cancel.
    ``timeout`` None: the inline timeout.
    """
    cfg = settings.load()
    timeout = cfg.callback_timeout if timeout is None else timeout
    event_id = delivery.event_id
    started = time.perf_counter()
    route = delivery_route(delivery.url, cfg)
    if route.refusal is not None:  # no request is made; a final refusal is not retried
        state = _record_attempt(event_id, delivery.attempts, None, route.refusal, cfg.callback_max_attempts,
                                final=route.final)
        metrics.callback_attempt(delivery.event, state, time.perf_counter() - started)
        log.warning("callback %s not sent: %s", event_id, route.refusal)
        return Answer(delivered=False, state=state)
    payload = dict(delivery.payload, sent_at=datetime.now(timezone.utc).isoformat())
    body = json.dumps(payload, separators=(",", ":"), default=str).encode()
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",  # the 64 KiB read bound counts the bytes the relay sends
        "X-Voice-Tools-Event": delivery.event,
        "X-Voice-Tools-Timestamp": timestamp,
        "X-Voice-Tools-Signature": sign(cfg.callback_secret, timestamp, body),
        "X-Voice-Tools-Event-Id": delivery.event_id,
    }
    if cfg.callback_secrets:  # Standard Webhooks: one signature per secret, newest first
        headers.update({
            "webhook-id": delivery.event_id,
            "webhook-timestamp": timestamp,
            "webhook-signature": sign_standard(cfg.callback_secrets, delivery.event_id, timestamp, body),
        })
    host = (urlsplit(delivery.url).hostname or "").lower()
    # requests and urllib3 (about 5 MB): a worker has them from its start (``tasks.app``), shared by its pool;
    # the API, which sends few callbacks itself (a cancel's ``cancelled``), at its first one
    from tasks.delivery.transport import exchange

    code, error, raw, note = exchange(delivery.url, body, headers, timeout,
                                      (host, route.address) if route.address else None, route.proxy)
    seconds = time.perf_counter() - started
    delivered = error is None
    cancel, reason = answers.read(raw) if delivered else (False, None)
    relay_cancels = cancel and answers.answers_a_cancel(delivery.payload)

    recorded: list[str] = []  # the row's state, once this attempt is recorded here

    def record_it() -> None:
        state = _record_attempt(event_id, delivery.attempts, code, error, cfg.callback_max_attempts, note=note,
                                took_s=seconds)
        recorded.append(state)
        metrics.callback_attempt(delivery.event, state, seconds)

    def hand_over() -> None:  # a delivered attempt: recorded with the others of the moment, off the link's clock
        delivered_attempts.record(event_id, code, note, took_s=seconds)
        metrics.callback_attempt(delivery.event, "delivered", seconds)

    if later is None or relay_cancels:
        record_it()
    else:
        later(hand_over if delivered else record_it)
    if relay_cancels:
        dispatch_quietly(answers.cancel(delivery.tool_call_id, reason))
    return Answer(delivered=delivered, cancel=cancel, reason=reason, state=recorded[0] if recorded else None)


def _record_attempt(event_id: str, attempts_before: int, code: int | None, error: str | None,
                    max_attempts: int, *, final: bool = False, note: str | None = None,
                    took_s: float | None = None) -> str:
    """Record one attempt on its row (its log entry: when, the answer's status, the error, how long it
    took); return the row's new state (delivered, pending or failed)."""
    delivered = error is None
    attempts = attempts_before + 1
    exhausted = not delivered and (final or attempts >= max_attempts)
    state = "delivered" if delivered else ("failed" if exhausted else "pending")
    next_at = None if delivered or exhausted else datetime.now(timezone.utc) + timedelta(seconds=backoff_s(attempts))
    log_entry: dict[str, Any] = {"at": datetime.now(timezone.utc).isoformat(), "response_code": code, "error": error}
    if took_s is not None:
        log_entry["took_ms"] = round(took_s * 1000, 1)
    if note:
        log_entry["note"] = note
    with db.statement() as s:  # one statement, its own transaction
        _RECORD_ATTEMPT.execute(s, {
            "a_id": event_id, "a_state": state, "a_code": code, "a_error": error, "a_next": next_at,
            "a_delivered": delivered, "a_log": [log_entry]})
    return state


# built once: the attempt's outcome on its row (only while still pending)
_RECORD_ATTEMPT = Compiled(
    update(CallbackDelivery.__table__)
    .where(CallbackDelivery.event_id == bindparam("a_id", type_=String), CallbackDelivery.state == "pending")
    .values(
        attempts=CallbackDelivery.attempts + 1, state=bindparam("a_state", type_=String),
        response_code=bindparam("a_code", type_=Integer), last_error=bindparam("a_error", type_=Text),
        next_attempt_at=bindparam("a_next", type_=DateTime(timezone=True)),
        delivered_at=case((bindparam("a_delivered", type_=Boolean), func.now()), else_=None),
        attempt_log=CallbackDelivery.attempt_log.op("||")(bindparam("a_log", type_=JSONB)),
    )
)


def deliver_inline(delivery: CallbackDelivery | None, later: Later | None = None) -> Answer | None:
    """Post a delivery recorded with ``inline=True`` now, with the short timeout;
    on failure hand the retries to the callbacks queue.

    ``later`` (see :func:`_post`): the attempt's recording, and the retry after a failed
    attempt, are left to it, in that order, instead of being done before returning.
    """
    if delivery is None:
        return None
    answer = _post(delivery, None, later)
    if not answer.delivered:
        def retry() -> None:
            try:
                schedule_retry(delivery.event_id)
            except (KombuOperationalError, RedisError, OSError):  # the link must not fail for it
                log.warning("broker unavailable: retry of event %s left for the sweep", delivery.event_id)

        (later or _now)(retry)
    return answer


def _now(work: Callable[[], None]) -> None:
    work()


def dispatch(delivery: CallbackDelivery | str | None) -> None:
    """Deliver from the callbacks queue (for faces that must not wait on the relay)."""
    if delivery is not None:
        event_id = delivery if isinstance(delivery, str) else delivery.event_id
        deliver.apply_async((event_id,))


def dispatch_quietly(delivery: CallbackDelivery | None) -> None:
    """:func:`dispatch`, leaving the event to the retry sweep when the broker is away."""
    try:
        dispatch(delivery)
    except (KombuOperationalError, RedisError, OSError):
        log.warning("broker unavailable: event %s left for the retry sweep", delivery and delivery.event_id)


def take_again(s: Session, event_ids: list[str]) -> list[str]:
    """An operator's redelivery, in the caller's transaction: make these deliveries due now (send each
    with :func:`dispatch` after the commit).

    Only rows with a URL that did not get through (``failed``, or ``pending`` while
    retrying) are taken; a ``failed`` one is ``pending`` again for one more attempt
    (its ``attempts`` stay counted, so a failure ends it ``failed`` again). Returns the
    event ids taken.
    """
    if not event_ids:
        return []
    return list(s.scalars(
        update(CallbackDelivery)
        .where(CallbackDelivery.event_id.in_(event_ids), CallbackDelivery.url.is_not(None),
               CallbackDelivery.state.in_(("failed", "pending")))
        .values(state="pending", next_attempt_at=func.now())
        .returning(CallbackDelivery.event_id)
        .execution_options(synchronize_session=False)
    ))


def schedule_retry(event_id: str) -> None:
    with db.session() as s:
        row = s.execute(
            select(CallbackDelivery.state, CallbackDelivery.next_attempt_at)
            .where(CallbackDelivery.event_id == event_id)
        ).one_or_none()
    if row is None or row.state != "pending":
        return
    # Whole seconds, rounded up: on RabbitMQ a delayed message waits in the broker's delay
    # queues (Celery's native delayed delivery), which count whole seconds, and Celery
    # refuses a delay under one second there (ValueError).
    wait_s = ((row.next_attempt_at or datetime.now(timezone.utc)) - datetime.now(timezone.utc)).total_seconds()
    deliver.apply_async((event_id,), countdown=math.ceil(wait_s) if wait_s > 0 else None)


@app.task(name="callbacks.deliver", ignore_result=True, acks_late=True, throws=(DeliveryFailed,))
def deliver(event_id: str) -> str:
    """One attempt from the queue; schedules the next one while attempts remain. The attempt that gives
    the delivery up raises :class:`DeliveryFailed` (the task's state FAILURE, logged without a traceback:
    an expected end, ``throws``); its message is acknowledged all the same (nothing to run again)."""
    # A queued retry may wait longer for a slow relay than the inline attempt, which is
    # on the caller's clock; otherwise a relay always slower than the inline timeout
    # would never get a single event.
    cfg = settings.load()
    answer = attempt(event_id, timeout=max(cfg.callback_timeout, cfg.callback_retry_timeout))
    if answer.delivered:
        return "delivered"
    if not answer.attempted:
        return "skipped"
    if answer.state == "failed":
        with db.session() as s:
            row = s.execute(select(CallbackDelivery.attempts, CallbackDelivery.last_error)
                            .where(CallbackDelivery.event_id == event_id)).one()
        raise DeliveryFailed(f"callback {event_id} given up after {row.attempts} attempts: {row.last_error}")
    schedule_retry(event_id)
    return "retry"
