"""Callback events to the relay (CONTRACT section 8).

Every event is a ``callback_deliveries`` row, inserted in the same transaction as the
transition that caused it. A link delivers it inline with a short timeout over one
pooled HTTP session per process; a failed attempt is retried on the ``callbacks``
queue with exponential backoff, and every attempt is recorded on the row. The body is
signed with HMAC-SHA256 over ``"<timestamp>.<body>"``. Redirects are not followed.

One attempt is bounded as a whole: a watchdog ends the exchange at the timeout (a
relay that drips a byte a second does not hold the link), and at most
``MAX_ANSWER_BYTES`` of the answer are read (a longer answer counts as no answer).
Before each attempt the URL is checked again (the allowlist of the moment, never
this system's own ports on a local address, a host name resolved and refused if it
points inside unless that address is listed) and the connection goes to the
address that was checked. Without a signing secret nothing is sent.

The relay may answer ``{"cancel": true}`` to a cancellable event; the engine
registers what to do then with :func:`on_relay_cancel` (this floor knows nothing of
tools or chains).
"""
from __future__ import annotations

import hashlib
import heapq
import hmac
import ipaddress
import json
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import ProxyManager
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError
from sqlalchemy import Row, bindparam, case, cast, func, insert, literal, null, or_, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert
from sqlalchemy.types import Boolean, DateTime, Integer, String, Text

from models import db, lifecycle, settings
from models.calls import EXECUTING, PENDING, PREPARED, CallbackDelivery, ToolCall
from tasks import app, worker_metrics

log = logging.getLogger(__name__)

EVENTS = ("progress", "checkpoint", "completed", "failed", "cancelled", "expired")
ENDINGS = ("completed", "failed", "cancelled", "expired")  # the events of a call's final status

_http: requests.Session | None = None
_cancel_handler: Callable[[str, str], None] | None = None


# -- the pooled HTTP session ----------------------------------------------------

MAX_ANSWER_BYTES = 64 * 1024  # more than any {"cancel": true, "reason": ...}; a longer answer is no answer
_local = threading.local()  # this thread's attempt: its watchdog and the address checked for its host


class _Watchdog:
    """One thread per process that ends attempts at their deadlines (a thread started per
    attempt costs a thread start on the caller's clock). Started lazily, so a forked
    child makes its own."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, "_Watch"]] = []
        self._count = 0
        self._pid = 0

    def add(self, watch: "_Watch", seconds: float) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use in this process (or after a fork)
                self._pid, self._due = os.getpid(), []
                threading.Thread(target=self._run, name="callback-watchdog", daemon=True).start()
            self._count += 1
            heapq.heappush(self._due, (time.monotonic() + seconds, self._count, watch))
            self._cond.notify()

    def _run(self) -> None:
        pid = os.getpid()
        with self._cond:
            while self._pid == pid:
                now = time.monotonic()
                while self._due and (self._due[0][2].done or self._due[0][0] <= now):
                    _, _, watch = heapq.heappop(self._due)
                    if not watch.done:
                        watch.fire()
                self._cond.wait(self._due[0][0] - now if self._due else None)


_watchdog = _Watchdog()


def _new_watchdog() -> None:
    global _watchdog
    _watchdog = _Watchdog()  # a child never inherits a lock its parent's watchdog thread held


os.register_at_fork(after_in_child=_new_watchdog)


class _Watch:
    """Ends one attempt's exchange at its deadline: shuts the connection's socket down,
    which ends a read however slowly the relay drips (a socket timeout is per read)."""

    def __init__(self, seconds: float):
        self._lock = threading.Lock()
        self._conn: HTTPConnection | None = None
        self._seconds = seconds
        self.done = False
        self.fired = False

    def attach(self, conn: HTTPConnection) -> None:
        with self._lock:
            self._conn = conn
            if self.fired:
                self._shut()

    def fire(self) -> None:
        with self._lock:
            if not self.done:
                self.fired = True
                self._shut()

    def _shut(self) -> None:
        sock = getattr(self._conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "_Watch":
        _local.watch = self
        _watchdog.add(self, self._seconds)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self.done = True  # the watchdog drops it when it next looks
        _local.watch = None


class _Watched:
    """A pooled connection that its attempt's watchdog can end, and that connects to
    the address the delivery checks approved (no second DNS answer in between)."""

    def request(self, *args: Any, **kwargs: Any) -> None:
        watch = getattr(_local, "watch", None)
        if watch is not None:
            watch.attach(self)  # type: ignore[arg-type]
        return super().request(*args, **kwargs)  # type: ignore[misc]

    def _new_conn(self) -> socket.socket:
        pin = getattr(_local, "pin", None)
        name = self._dns_host  # type: ignore[attr-defined]
        if pin is None or pin[0] != name:
            return super()._new_conn()  # type: ignore[misc]
        self._dns_host = pin[1]
        try:
            return super()._new_conn()  # type: ignore[misc]
        finally:
            self._dns_host = name


class _HTTPConnection(_Watched, HTTPConnection):
    pass


class _HTTPSConnection(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class _Adapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        """Through an HTTP proxy (``HTTP_PROXY``) the watchdog still bounds the attempt (the proxy resolves the name)."""
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if type(manager) is ProxyManager:  # a SOCKS manager keeps its own connections
            manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
        return manager


def http() -> requests.Session:
    global _http
    if _http is None:
        session = requests.Session()
        adapter = _Adapter(pool_connections=20, pool_maxsize=20, max_retries=0)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        session.headers["User-Agent"] = "voice-tools-callbacks/1"
        _http = session
    return _http


def reset_http_session() -> None:
    global _http
    _http = None


# -- which URLs may be called ---------------------------------------------------

OWN_PORTS = (("PORT", 8000, "API"), ("MCP_PORT", 8001, "MCP"), ("FLOWER_PORT", 5555, "Flower"))


def own_ports() -> dict[int, str]:
    """This system's own ports (the API, MCP and Flower; ``voice-tools run``'s defaults when unset)."""
    found = {}
    for name, default, face in OWN_PORTS:
        raw = os.environ.get(name, "").strip()
        found[int(raw) if raw.isdigit() else default] = face
    return found


def url_error(url: str, allowed: list[str] | None = None) -> str | None:
    """Why ``url`` may not be a callback_url, or None if it may.

    Its host (and port, when the entry names one; a bare host admits any port) must
    be listed in ``VOICE_TOOLS_CALLBACK_HOSTS``. An IP literal in a private,
    loopback or link-local range is refused unless it is listed itself. This
    system's own API, MCP and Flower ports on a local address are refused whatever
    is listed.
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
    own = own_ports().get(port)
    if own is not None and _is_local(host):
        return f"port {port} on {host} is this system's own {own} port"
    if _listed(host, port, allowed):
        return None
    try:
        ip = ipaddress.ip_address(host)
        if _inside(ip):
            return f"host {host} is a private address and is not in VOICE_TOOLS_CALLBACK_HOSTS"
    except ValueError:
        pass
    return f"host {host} is not in VOICE_TOOLS_CALLBACK_HOSTS"


def _listed(host: str, port: int, allowed: list[str]) -> bool:
    for entry in allowed:
        name, _, entry_port = entry.lower().rpartition(":") if _has_port(entry) else (entry.lower(), "", "")
        if name.strip("[]") == host and (not entry_port or int(entry_port) == port):
            return True
    return False


def _has_port(entry: str) -> bool:
    head, sep, tail = entry.rpartition(":")
    return bool(sep) and tail.isdigit() and (not head.count(":") or head.endswith("]"))


def _inside(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Not a public address: private, loopback, link-local (cloud metadata), reserved, unspecified, multicast."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_unspecified
            or ip.is_multicast)


def _is_local(host: str) -> bool:
    """Is ``host`` this machine: a loopback or unspecified address, localhost, or one of its interfaces'?"""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified or str(ip) in _own_addresses()


def _own_addresses() -> set[str]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with the run command's dependencies
        return set()
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def delivery_refusal(url: str, cfg: settings.Settings | None = None) -> tuple[str | None, str | None]:
    """Checked again before every attempt: ``(why not, None)`` or ``(None, address to connect to)``.

    The URL must pass :func:`url_error` with the allowlist of the moment (a host
    removed since the call was recorded is not posted to), and the signing secret
    must be set. A host name is resolved now: if any of its addresses is not public
    (private, loopback, link-local, ...) the address itself must be listed (a listed
    name does not admit an inside address, except ``localhost``, which is loopback by
    definition), and no address may be this system's own port. The attempt then
    connects to the address checked here. A name that does not resolve is left to the
    request (an ordinary failed attempt, retried). ``cfg``: the settings already read by the caller.
    """
    cfg = cfg or settings.load()
    if not cfg.callback_secret.strip():
        return "refused: VOICE_TOOLS_CALLBACK_SECRET is empty; an unsigned callback is not sent", None
    reason = url_error(url, cfg.callback_hosts)
    if reason is not None:
        return f"refused: the callback URL {reason}", None
    parts = urlsplit(url)
    host = parts.hostname.lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
        return None, None  # an IP literal: url_error has judged it
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None, None
    addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
    own = own_ports().get(port)
    loopback_name = host == "localhost" or host.endswith(".localhost")
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if own is not None and _is_local(address):
            return f"refused: {host} resolves to {address}, and port {port} is this system's own {own} port", None
        if _inside(ip) and not _listed(address, port, cfg.callback_hosts) and not (loopback_name and ip.is_loopback):
            return (f"refused: {host} resolves to {address}, a private address that is not itself in "
                    f"VOICE_TOOLS_CALLBACK_HOSTS"), None
    return None, addresses[0] if addresses else None


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
    if event in ENDINGS:  # every ending records its event once: counted when it has committed
        db.after_commit(s, worker_metrics.call_ended, call.function_name, call.status)
    return delivery if url else None


class Event:
    """A callback event to record in the statement of the transition that causes it
    (``lifecycle.record_step(..., event=...)``); made by :func:`event`."""

    def __init__(self, shape: tuple[str, bool, bool], params: dict[str, Any]):
        self.shape = shape  # (event, requires_confirmation, inline): what the INSERT looks like
        self.params = params

    def build(self, moved: Any) -> Insert:
        return _event_insert(moved, *self.shape)


def event(
    event: str,
    *,
    step: str,
    gate: int,
    progress: float,
    message: str = "",
    cancellable: bool = False,
    requires_confirmation: bool = False,
    preview: dict[str, Any] | None = None,
    context_key: str | None = None,
    inline: bool = False,
) -> Event:
    """The event :func:`record` would insert, for the transition's own statement to insert.

    A link's transitions take their event in the statement that changes the call: the
    ``INSERT ... SELECT`` from the updated row (``moved``) writes the same row and payload
    :func:`record` writes (what Python knows now as parameters; the row's columns, its new
    ``event_seq`` and its URL from the row). ``progress`` is the progress the transition
    sets. The returned row is turned back into a delivery by :func:`delivery_of`.
    """
    cfg = settings.load()
    event_id = uuid.uuid4().hex
    constant: dict[str, Any] = {
        "event_id": event_id, "type": "tool_status", "event": event, "step": step, "gate": gate,
        "progress": progress, "message": message, "cancellable": cancellable,
        "requires_confirmation": requires_confirmation, "preview": preview,
        "context_available": context_key is not None, "context_key": context_key,
    }
    return Event((event, requires_confirmation, inline), {
        "ev_id": event_id, "ev_constant": constant, "ev_step": step,
        "ev_voice": message if event != "progress" else None,
        "ev_resume": f"{cfg.public_url}/voice-tools/resume/",
        "ev_lease": datetime.now(timezone.utc) + timedelta(seconds=_lease_s(cfg.callback_timeout)),
    })


def _event_insert(moved: Any, event: str, requires_confirmation: bool, inline: bool) -> Insert:
    """The INSERT of an :class:`Event`'s row (bind parameters ``ev_*``) from the transition's row ``moved``."""
    def text_param(name: str) -> Any:
        return bindparam(name, type_=Text)

    url = func.coalesce(func.nullif(moved.c.callback_urls.op("->>")(event), ""), func.nullif(moved.c.callback_url, ""))
    resume_url = text_param("ev_resume") + moved.c.tool_call_id if requires_confirmation else null()
    actions = case({status: cast(bindparam(None, actions_available(status), type_=JSONB), JSONB)
                    for status in (PENDING, EXECUTING, PREPARED)},
                   value=moved.c.status, else_=cast(literal("[]"), JSONB))
    row = func.jsonb_build_object(
        "tool_call_id", moved.c.tool_call_id, "intent_id", moved.c.intent_id,
        "session_id", moved.c.session_id, "function_name", moved.c.function_name,
        "parameters", moved.c.parameters, "status", moved.c.status, "resume_url", resume_url,
        "actions_available", actions, "result", moved.c.result,
        "voice_response", func.coalesce(func.nullif(moved.c.voice_response, ""), text_param("ev_voice")),
        "execution_time_ms", moved.c.execution_time_ms, "seq", moved.c.event_seq,
    )
    if event == "checkpoint":  # the names seed 000's /tool-checkpoint handler reads
        row = row.op("||")(func.jsonb_build_object("checkpoint", bindparam("ev_step", type_=String),
                                                   "resume_webhook", resume_url))
    payload = bindparam("ev_constant", type_=JSONB).op("||")(row)
    lease = bindparam("ev_lease", type_=DateTime(timezone=True))
    chosen = select(
        bindparam("ev_id", type_=String), moved.c.tool_call_id, moved.c.session_id, literal(event),
        moved.c.event_seq, payload, url, case((url.is_(None), "none"), else_="pending"), literal(0),
        case((url.is_not(None), lease), else_=None) if inline else null(),
    )
    return insert(CallbackDelivery).from_select(
        ["event_id", "tool_call_id", "session_id", "event", "seq", "payload", "url", "state", "attempts",
         "next_attempt_at"], chosen,
    ).returning(CallbackDelivery.event_id.label("delivery_event_id"), CallbackDelivery.url.label("delivery_url"),
                CallbackDelivery.payload.label("delivery_payload"), CallbackDelivery.event.label("delivery_event"))


def delivery_of(row: Row[Any] | None) -> CallbackDelivery | None:
    """The delivery to post from a transition's row that recorded its event with :func:`event`
    (None: no URL takes the event, or the transition did not apply)."""
    if row is None or row.delivery_url is None:
        return None
    return CallbackDelivery(event_id=row.delivery_event_id, tool_call_id=row.tool_call_id, session_id=row.session_id,
                            event=row.delivery_event, seq=row.event_seq, payload=row.delivery_payload,
                            url=row.delivery_url, state="pending", attempts=0)


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


Later = Callable[[Callable[[], None]], None]


def _post(delivery: CallbackDelivery, timeout: float | None, later: Later | None = None) -> Answer:
    """Post a claimed delivery, record the attempt, act on the relay's answer.

    ``later``: where to leave the recording of the attempt to be run once the caller's
    work is done (a link: after its chain's next link is sent), so the caller does not
    wait for it. An answer asking to cancel is recorded at once, before the cancel.
    ``timeout`` None: the inline timeout.
    """
    cfg = settings.load()
    timeout = cfg.callback_timeout if timeout is None else timeout
    event_id = delivery.event_id
    started = time.perf_counter()
    refusal, address = delivery_refusal(delivery.url, cfg)
    if refusal is not None:  # no request is made; retrying would be refused the same way
        state = _record_attempt(event_id, delivery.attempts, None, refusal, cfg.callback_max_attempts, final=True)
        worker_metrics.callback_attempt(delivery.event, state, time.perf_counter() - started)
        log.warning("callback %s not sent: %s", event_id, refusal)
        return Answer(delivered=False)
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
    host = (urlsplit(delivery.url).hostname or "").lower()
    code, error, raw, note = _exchange(delivery.url, body, headers, timeout, (host, address) if address else None)
    seconds = time.perf_counter() - started
    answer: Any = None
    if error is None and raw:
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
    delivered = error is None
    cancel = bool(isinstance(answer, dict) and answer.get("cancel") is True)
    reason = answer.get("reason") if cancel and isinstance(answer.get("reason"), str) else None
    relay_cancels = cancel and _is_cancellable(delivery.payload)

    def record_it() -> None:
        state = _record_attempt(event_id, delivery.attempts, code, error, cfg.callback_max_attempts, note=note)
        worker_metrics.callback_attempt(delivery.event, state, seconds)

    if later is None or relay_cancels:
        record_it()
    else:
        later(record_it)
    if relay_cancels:
        _relay_cancel(delivery.tool_call_id, reason or "Cancelled by the relay")
    return Answer(delivered=delivered, cancel=cancel, reason=reason)


def _exchange(url: str, body: bytes, headers: dict[str, str], timeout: float,
              pin: tuple[str, str] | None) -> tuple[int | None, str | None, bytes, str | None]:
    """One request and its answer, all of it within ``timeout`` seconds and ``MAX_ANSWER_BYTES``.

    Returns (status code, error or None, the answer's bytes of a 2xx, a note). A 2xx
    whose answer is longer than the limit is delivered with no answer (noted).
    """
    code: int | None = None
    error: str | None = None
    raw = b""
    note: str | None = None
    _local.pin = pin
    try:
        with _Watch(timeout) as watch:
            try:
                response = http().post(url, data=body, headers=headers, timeout=(timeout, timeout),
                                       allow_redirects=False, stream=True)
                try:
                    code = response.status_code
                    if 200 <= code < 300:
                        chunks, size = [], 0
                        for chunk in response.iter_content(16384):
                            chunks.append(chunk)
                            size += len(chunk)
                            if size > MAX_ANSWER_BYTES:
                                note = f"answer over {MAX_ANSWER_BYTES} bytes: read as no answer"
                                break
                        raw = b"" if note else b"".join(chunks)
                    else:
                        error = f"HTTP {code}"
                finally:
                    response.close()  # a connection left mid-answer is closed, not pooled
            except requests.RequestException as exc:
                error = f"{type(exc).__name__}: {exc}"[:500]
            if watch.fired:  # whatever the cut connection raised, the truth is the deadline
                error, raw, note = f"Timeout: no complete answer within {timeout:g} s", b"", None
    finally:
        _local.pin = None
    return code, error, raw, note


def _record_attempt(event_id: str, attempts_before: int, code: int | None, error: str | None,
                    max_attempts: int, *, final: bool = False, note: str | None = None) -> str:
    """Record one attempt on its row; return the row's new state (delivered, pending or failed)."""
    delivered = error is None
    attempts = attempts_before + 1
    exhausted = not delivered and (final or attempts >= max_attempts)
    state = "delivered" if delivered else ("failed" if exhausted else "pending")
    next_at = None if delivered or exhausted else datetime.now(timezone.utc) + timedelta(seconds=backoff_s(attempts))
    log_entry: dict[str, Any] = {"at": datetime.now(timezone.utc).isoformat(), "response_code": code, "error": error}
    if note:
        log_entry["note"] = note
    # one statement, its own transaction; a delivered attempt's record need not wait for the WAL
    # flush: lost with a crashed database server, the row is pending again and is delivered
    # again by the retry sweep (at least once, the same event_id) (models/db.py statement)
    with db.statement(durable=not delivered) as s:
        s.execute(_RECORD_ATTEMPT, {
            "a_id": event_id, "a_state": state, "a_code": code, "a_error": error, "a_next": next_at,
            "a_delivered": delivered, "a_log": [log_entry]})
    return state


# built once: the attempt's outcome on its row (only while still pending)
_RECORD_ATTEMPT = (
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


def _is_cancellable(payload: dict[str, Any]) -> bool:
    return bool(payload.get("cancellable")) or payload.get("event") == "checkpoint"


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
    # Whole seconds, rounded up: on RabbitMQ a delayed message waits in the broker's delay
    # queues (Celery's native delayed delivery), which count whole seconds, and Celery
    # refuses a delay under one second there (ValueError).
    wait_s = ((row.next_attempt_at or datetime.now(timezone.utc)) - datetime.now(timezone.utc)).total_seconds()
    deliver.apply_async((event_id,), countdown=math.ceil(wait_s) if wait_s > 0 else None)


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
