"""Callback events to the relay (CONTRACT section 8).

Every event is a ``callback_deliveries`` row, inserted in the same transaction as the
transition that caused it. A link delivers it inline with a short timeout over one
pooled HTTP session per process; a failed attempt is retried on the ``callbacks``
queue with exponential backoff, and every attempt is recorded on the row. The body is
signed with HMAC-SHA256 over ``"<timestamp>.<body>"``. Redirects are not followed.

The relay may answer ``{"cancel": true}`` to a cancellable event; the engine
registers what to do then with :func:`on_relay_cancel` (this floor knows nothing of
tools or chains).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError
from sqlalchemy import bindparam, func, or_, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from models import db, lifecycle, settings
from models.calls import EXECUTING, PENDING, PREPARED, CallbackDelivery, ToolCall
from tasks import app

log = logging.getLogger(__name__)

EVENTS = ("progress", "checkpoint", "completed", "failed", "cancelled", "expired")

_http: requests.Session | None = None
_cancel_handler: Callable[[str, str], None] | None = None


# -- the pooled HTTP session ----------------------------------------------------

def http() -> requests.Session:
    global _http
    if _http is None:
        session = requests.Session()
        adapter = HTTPAdapter(pool_connections=20, pool_maxsize=20, max_retries=0)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        session.headers["User-Agent"] = "voice-tools-callbacks/1"
        _http = session
    return _http


def reset_http_session() -> None:
    global _http
    _http = None


# -- which URLs may be called ---------------------------------------------------

def url_error(url: str, allowed: list[str] | None = None) -> str | None:
    """Why ``url`` may not be a callback_url, or None if it may.

    Its host (and port, when the entry names one) must be listed in
    ``VOICE_TOOLS_CALLBACK_HOSTS``. An IP literal in a private, loopback or
    link-local range is refused unless it is listed itself.
    """
    allowed = settings.load().callback_hosts if allowed is None else allowed
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "is not a valid URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http or https URL with a host"
    if parts.username is not None or parts.password is not None:
        return "must not hold credentials (user:password@); callbacks are signed instead"
    host = parts.hostname.lower()
    port = port or (443 if parts.scheme == "https" else 80)
    for entry in allowed:
        name, _, entry_port = entry.lower().rpartition(":") if _has_port(entry) else (entry.lower(), "", "")
        if name.strip("[]") == host and (not entry_port or int(entry_port) == port):
            return None
    try:
        ip = ipaddress.ip_address(host)
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved:
            return f"host {host} is a private address and is not in VOICE_TOOLS_CALLBACK_HOSTS"
    except ValueError:
        pass
    return f"host {host} is not in VOICE_TOOLS_CALLBACK_HOSTS"


def _has_port(entry: str) -> bool:
    head, sep, tail = entry.rpartition(":")
    return bool(sep) and tail.isdigit() and (not head.count(":") or head.endswith("]"))


# -- building and recording events ------------------------------------------------

def actions_available(status: str) -> list[str]:
    return {
        PENDING: ["confirm", "modify", "cancel"],
        EXECUTING: ["cancel"],
        PREPARED: ["proceed", "cancel"],
    }.get(status, [])


def record(
    s: Session,
    call: ToolCall,
    event: str,
    *,
    step: str | None = None,
    gate: int | None = None,
    message: str = "",
    cancellable: bool = False,
    requires_confirmation: bool = False,
    preview: dict[str, Any] | None = None,
    context_key: str | None = None,
    inline: bool = False,
) -> CallbackDelivery | None:
    """Insert the event's row; return it to be delivered (None: no URL takes this event).

    Every event is recorded, with or without a URL: the session's event stream
    (``GET /voice-tools/events/<session_id>``) reads the same rows.

    The URL is the call's ``callback_urls[event]`` if it names one, else its
    ``callback_url``.

    ``call`` is the row a transition just returned; ``seq`` is the call's next event number.
    ``inline``: the caller will post it at once with :func:`deliver_inline`, so the row
    is inserted already claimed for that attempt (no second statement to claim it).
    """
    url = url_for(call, event)
    event_id = uuid.uuid4().hex
    seq = lifecycle.next_event_seq(s, call.tool_call_id)
    public = settings.load().public_url
    resume_url = f"{public}/voice-tools/resume/{call.tool_call_id}" if requires_confirmation else None
    payload = {
        "event_id": event_id,
        "type": "tool_status",
        "event": event,
        "tool_call_id": call.tool_call_id,
        "intent_id": call.intent_id,
        "session_id": call.session_id,
        "function_name": call.function_name,
        "parameters": call.parameters,
        "status": call.status,
        "step": step or call.current_step,
        "gate": gate,
        "progress": call.progress,
        "message": message,
        "cancellable": cancellable,
        "requires_confirmation": requires_confirmation,
        "preview": preview,
        "resume_url": resume_url,
        "actions_available": actions_available(call.status),
        "result": call.result,
        "voice_response": call.voice_response or (message if event != "progress" else None),
        "execution_time_ms": call.execution_time_ms,
        "context_available": context_key is not None,
        "context_key": context_key,
        "seq": seq,
    }
    if event == "checkpoint":  # the names seed 000's /tool-checkpoint handler reads
        payload.update(checkpoint=step or call.current_step, resume_webhook=resume_url)
    lease = datetime.now(timezone.utc) + timedelta(seconds=_lease_s(settings.load().callback_timeout))
    delivery = CallbackDelivery(
        event_id=event_id, tool_call_id=call.tool_call_id, session_id=call.session_id, event=event, seq=seq,
        payload=payload, url=url, state="pending" if url else "none", attempts=0,
        next_attempt_at=lease if inline and url else None,
    )
    s.add(delivery)
    return delivery if url else None


def url_for(call: ToolCall, event: str) -> str | None:
    """Where ``event`` of ``call`` goes: its own URL in ``callback_urls``, else ``callback_url``."""
    return (call.callback_urls or {}).get(event) or call.callback_url


def sign(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


# -- delivering -------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    delivered: bool
    cancel: bool = False
    reason: str | None = None
    attempted: bool = True  # False: not due, in flight elsewhere, or no longer pending


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


def _lease_s(timeout: float) -> float:
    """How long an attempt holds its row: the request's timeout and some slack."""
    return timeout + 5


def attempt(event_id: str, timeout: float | None = None) -> Answer:
    """Post the event once, if it is due, and record the attempt on its row."""
    timeout = timeout or settings.load().callback_timeout
    delivery = _claim(event_id, lease_s=_lease_s(timeout))
    if delivery is None:
        with db.session() as s:
            state = s.scalar(select(CallbackDelivery.state).where(CallbackDelivery.event_id == event_id))
        return Answer(delivered=state == "delivered", attempted=False)
    return _post(delivery, timeout)


def _post(delivery: CallbackDelivery, timeout: float) -> Answer:
    """Post a claimed delivery, record the attempt, act on the relay's answer."""
    cfg = settings.load()
    event_id = delivery.event_id
    payload = dict(delivery.payload, sent_at=datetime.now(timezone.utc).isoformat())
    body = json.dumps(payload, separators=(",", ":"), default=str).encode()
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "X-Voice-Tools-Event": delivery.event,
        "X-Voice-Tools-Timestamp": timestamp,
        "X-Voice-Tools-Signature": sign(cfg.callback_secret, timestamp, body),
        "X-Voice-Tools-Event-Id": delivery.event_id,
    }
    code: int | None = None
    error: str | None = None
    answer: Any = None
    try:
        response = http().post(delivery.url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
        code = response.status_code
        if 200 <= code < 300:
            try:
                answer = response.json()
            except ValueError:
                answer = None
        else:
            error = f"HTTP {code}"
    except requests.RequestException as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    delivered = error is None
    attempts = delivery.attempts + 1
    exhausted = not delivered and attempts >= cfg.callback_max_attempts
    state = "delivered" if delivered else ("failed" if exhausted else "pending")
    next_at = None if delivered or exhausted else datetime.now(timezone.utc) + timedelta(seconds=backoff_s(attempts))
    log_entry = {"at": datetime.now(timezone.utc).isoformat(), "response_code": code, "error": error}
    with db.session() as s:
        s.execute(
            update(CallbackDelivery)
            .where(CallbackDelivery.event_id == event_id, CallbackDelivery.state == "pending")
            .values(
                attempts=CallbackDelivery.attempts + 1, state=state, response_code=code, last_error=error,
                next_attempt_at=next_at, delivered_at=func.now() if delivered else None,
                attempt_log=CallbackDelivery.attempt_log.op("||")(bindparam(None, [log_entry], type_=JSONB)),
            )
            .execution_options(synchronize_session=False)
        )
    cancel = bool(isinstance(answer, dict) and answer.get("cancel") is True)
    reason = answer.get("reason") if cancel and isinstance(answer.get("reason"), str) else None
    if cancel and _is_cancellable(delivery.payload):
        _relay_cancel(delivery.tool_call_id, reason or "Cancelled by the relay")
    return Answer(delivered=delivered, cancel=cancel, reason=reason)


def _is_cancellable(payload: dict[str, Any]) -> bool:
    return bool(payload.get("cancellable")) or payload.get("event") == "checkpoint"


def deliver_inline(delivery: CallbackDelivery | None) -> Answer | None:
    """Post a delivery recorded with ``inline=True`` now, with the short timeout;
    on failure hand the retries to the callbacks queue."""
    if delivery is None:
        return None
    answer = _post(delivery, settings.load().callback_timeout)
    if not answer.delivered:
        try:
            schedule_retry(delivery.event_id)
        except (KombuOperationalError, RedisError, OSError):  # the link must not fail for it
            log.warning("broker unavailable: retry of event %s left for the sweep", delivery.event_id)
    return answer


def dispatch(delivery: CallbackDelivery | str | None) -> None:
    """Deliver from the callbacks queue (for faces that must not wait on the relay)."""
    if delivery is not None:
        event_id = delivery if isinstance(delivery, str) else delivery.event_id
        deliver.apply_async((event_id,))


def redeliver(event_ids: list[str]) -> list[str]:
    """An operator's redelivery: make these deliveries due now and send each from the callbacks queue.

    Only rows with a URL that did not get through (``failed``, or ``pending`` while
    retrying) are taken; a ``failed`` one is ``pending`` again for one more attempt
    (its ``attempts`` stay counted, so a failure ends it ``failed`` again). Returns the
    event ids queued.
    """
    if not event_ids:
        return []
    with db.session() as s:
        taken = list(s.scalars(
            update(CallbackDelivery)
            .where(CallbackDelivery.event_id.in_(event_ids), CallbackDelivery.url.is_not(None),
                   CallbackDelivery.state.in_(("failed", "pending")))
            .values(state="pending", next_attempt_at=func.now())
            .returning(CallbackDelivery.event_id)
            .execution_options(synchronize_session=False)
        ))
    for event_id in taken:
        dispatch(event_id)
    return taken


def schedule_retry(event_id: str) -> None:
    with db.session() as s:
        row = s.execute(
            select(CallbackDelivery.state, CallbackDelivery.next_attempt_at)
            .where(CallbackDelivery.event_id == event_id)
        ).one_or_none()
    if row is None or row.state != "pending":
        return
    eta = row.next_attempt_at or datetime.now(timezone.utc)
    deliver.apply_async((event_id,), eta=eta)


@app.task(name="callbacks.deliver", ignore_result=True, acks_late=True)
def deliver(event_id: str) -> str:
    """One attempt from the queue; schedules the next one while attempts remain."""
    # A queued retry may wait longer for a slow relay than the inline attempt, which is
    # on the caller's clock; otherwise a relay always slower than the inline timeout
    # would never get a single event.
    cfg = settings.load()
    answer = attempt(event_id, timeout=max(cfg.callback_timeout, cfg.callback_retry_timeout))
    if answer.delivered:
        return "delivered"
    if not answer.attempted:
        return "skipped"
    schedule_retry(event_id)
    return "retry"


def due_event_ids(s: Session, grace_s: int = 30, limit: int = 500) -> list[str]:
    """Pending deliveries overdue by ``grace_s`` (their retry message was lost)."""
    return list(s.scalars(
        select(CallbackDelivery.event_id).where(
            CallbackDelivery.state == "pending",
            func.coalesce(CallbackDelivery.next_attempt_at, CallbackDelivery.created_at)
            < func.now() - timedelta(seconds=grace_s),
        ).limit(limit)
    ).all())


# -- the relay asked to cancel ------------------------------------------------------

def on_relay_cancel(handler: Callable[[str, str], None]) -> Callable[[str, str], None]:
    """Register what to do when the relay answers ``{"cancel": true}`` (the engine does)."""
    global _cancel_handler
    _cancel_handler = handler
    return handler


def _relay_cancel(tool_call_id: str, reason: str) -> None:
    if _cancel_handler is None:
        log.warning("relay asked to cancel %s but no handler is registered", tool_call_id)
        return
    _cancel_handler(tool_call_id, reason)
