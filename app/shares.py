"""Each caller's fair share of the API, on every face (REST, the event stream, MCP): a rate of requests
and a number of long-held requests at once (``?wait`` and open event streams), and each API process's
capacity for long-held requests, shared fairly between the callers holding them there
(docs/operations.md, "Fair shares"; docs/relay-guide.md, "Limits and small rules").

The rate and the open share are counted per caller name in the Redis the API processes share
(``models.settings.redis_url``: ``REDIS_URL`` or a Redis broker), so they hold across gunicorn workers,
hosts and faces; in this process's memory where no Redis is configured. The rate is the `limits`
library's sliding window counter (the library beneath Flask-Limiter, which serves Flask only: the MCP
face is Starlette). A long-held request takes a *slot*: a member of the caller's sorted set whose score
is its lease's end, renewed by its process every ``RENEW_EVERY_S`` whatever its client does (a thread of
the process renews them all), so a lease lapses only when its process is gone.

A stream or a wait served by the process's stream loop (``app/stream_loop.py``) holds no web thread: it
costs a descriptor and a few KB. The process serves at most ``settings.open_per_process`` of them
(``VOICE_TOOLS_OPEN_PER_PROCESS``, within its open-files limit), and a caller takes no more of that than
its fair part: an equal part among the callers holding slots in the process, three quarters when it is
alone there (the rest waits for the next caller), so no caller takes the whole process. A long-held
request that does hold a thread (one served where the server gives no socket to hand over) counts
against the process's threads instead: under gunicorn each process keeps ``settings.RESERVED_THREADS``
of its threads from them. Past the rate, the open share or the process's capacity: :class:`ApiError`
429 with ``Retry-After``, before the request does anything. A Redis that does not answer lets
requests through (logged): the limits protect the service, they must not stop it.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import resource
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from limits import parse
from limits.storage import MemoryStorage, RedisStorage, Storage
from limits.strategies import SlidingWindowCounterRateLimiter

import voice_tools_tracing as tracing
from models import settings
from tasks.calls.errors import ApiError

log = logging.getLogger(__name__)

LEASE_S = 60.0  # a slot not renewed for this long is free again (its process was killed)
RENEW_EVERY_S = 15.0  # the process renews every slot it holds this often
OPEN_RETRY_AFTER_S = 5  # a stream's slot frees when a stream closes
WAIT_RETRY_AFTER_S = 1  # a wait's slot frees when a wait ends: most end within a second
KEY_PREFIX = "voice-tools:shares"

# Take a slot if the caller holds fewer than ARGV[1] live ones: drop the lapsed, count, add.
# Redis's own clock, so that every host counts leases alike.
_TAKE = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[1]) then return -held end
redis.call('ZADD', KEYS[1], t + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000))
return held + 1
"""
# Renew the caller's slots ARGV[2..] (those still held) for ARGV[1] seconds: every slot of a caller in one
# command, so that renewing a thousand costs the process one command's work, not a thousand.
_RENEW = """
local now = redis.call('TIME')
local until_t = tonumber(now[1]) + tonumber(now[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', until_t, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000))
return #ARGV - 1
"""


@dataclass(frozen=True)
class Share:
    """A caller's share: its rate (``limits`` notation) and how many long-held requests it may hold."""

    rate: str
    open: int


def share_of(name: str) -> Share:
    """Caller ``name``'s share: its own (``VOICE_TOOLS_CALLER_LIMITS``), else the defaults; settings
    that cannot be read are logged and the built-in defaults used (never a 500 on every request).
    Read again only when the environment has changed (every request asks)."""
    return _share_of(name, settings.generation())


@functools.lru_cache(maxsize=1024)
def _share_of(name: str, _environment: int) -> Share:
    try:
        rate, opened = settings.caller_limits().get(name, (None, None))
        share = Share(rate or settings.rate_limit(), opened or settings.open_per_caller())
        _rate_item(share.rate)
        return share
    except ValueError as exc:
        log.error("fair share settings not readable (%s): the built-in defaults apply", exc)
        return Share(settings.RATE_LIMIT, settings.OPEN_PER_CALLER)


_rate_item = functools.lru_cache(maxsize=64)(parse)  # a rate in the `limits` notation, parsed once


# -- where the counts live: one per process, made after the fork --------------------------------------

class _Counts:
    def __init__(self) -> None:
        url = settings.redis_url()
        self.client: redis.Redis | None = None
        self._memory: Storage | None = None
        self._threads = threading.local()  # with Redis: this thread's limiter, on a connection of its own
        if url:
            url = url.replace("redis+socket://", "unix://", 1)
            self.client = tracing.redis_client(redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2))
            self.take = self.client.register_script(_TAKE)
            self.renew = self.client.register_script(_RENEW)
        else:
            self._memory = MemoryStorage()
            self._shared = SlidingWindowCounterRateLimiter(self._memory)
        self.local: dict[str, dict[str, float]] = {}  # without Redis: caller -> {slot: lease end}
        self.lock = threading.Lock()

    @property
    def limiter(self) -> SlidingWindowCounterRateLimiter:
        """The rate's counter. With Redis, one per thread, holding a connection of the pool for the thread's
        life: the count is every request's one round trip, and redis-py's taking and giving back a pooled
        connection cost as much CPU again as the command (py-spy of the API under load)."""
        if self.client is None:
            return self._shared
        limiter = getattr(self._threads, "limiter", None)
        if limiter is None:
            storage = RedisStorage("redis://", connection_pool=self.client.connection_pool,
                                   key_prefix=f"{KEY_PREFIX}:rate", single_connection_client=True)
            tracing.redis_client(storage.storage)  # the client the storage made on the pool
            limiter = self._threads.limiter = SlidingWindowCounterRateLimiter(storage)
        return limiter


_counts: tuple[int, str, _Counts] | None = None
_counts_lock = threading.Lock()


def counts() -> _Counts:
    global _counts
    key = (os.getpid(), settings.redis_url())
    with _counts_lock:
        if _counts is None or _counts[:2] != key:
            _counts = (*key, _Counts())
        return _counts[2]


# -- the rate ---------------------------------------------------------------------------------------------

def check_rate(name: str) -> None:
    """Count one request of caller ``name``; :class:`ApiError` 429 ``rate_limited`` past its rate."""
    item = _rate_item(share_of(name).rate)
    where = counts()
    try:
        if where.limiter.hit(item, "caller", name):
            return
        stats = where.limiter.get_window_stats(item, "caller", name)
    except redis.RedisError as exc:
        log.warning("rate limit not counted (Redis: %s)", exc)
        return
    retry_after = max(1, math.ceil(stats.reset_time - time.time()))
    raise ApiError(429, "rate_limited",
                   f"Too many requests from this caller: at most {item}. Try again in {retry_after} s.",
                   {"limit": str(item), "retry_after": retry_after}, {"Retry-After": str(retry_after)})


# -- long-held requests: slots -------------------------------------------------------------------------------

# -- this process's threads: under gunicorn (app/gunicorn_conf.py), long-held requests that hold a thread
# (served where no socket could be handed to the stream loop) leave ``settings.RESERVED_THREADS`` of each
# worker's threads to /healthz and short requests

_process_threads: int | None = None
_process_held = 0
_process_lock = threading.Lock()


def serve_with_threads(threads: int | None) -> None:
    """This process answers on ``threads`` threads (None: not known, no guard)."""
    global _process_threads, _process_held
    with _process_lock:
        _process_threads, _process_held = threads, 0


def _retry_after(kind: str) -> int:
    return WAIT_RETRY_AFTER_S if kind == "wait" else OPEN_RETRY_AFTER_S


def _server_full(kind: str, held: int, most: int, what: str) -> ApiError:
    retry_after = _retry_after(kind)
    return ApiError(429, "too_many_open", f"{what}; try again in {retry_after} s.",
                    {"kind": kind, "scope": "server", "open": held, "limit": most, "retry_after": retry_after},
                    {"Retry-After": str(retry_after)})


def _enter_process(kind: str) -> bool:
    """Count a long-held request that holds a thread in this process (False: no guard here); 429 when full."""
    global _process_held
    with _process_lock:
        if _process_threads is None:
            return False
        most = max(1, _process_threads - settings.RESERVED_THREADS)
        if _process_held < most:
            _process_held += 1
            return True
    raise _server_full(kind, most, most, f"This server already holds {most} long-held requests on its threads, "
                                         "all it keeps for them")


def _leave_process() -> None:
    global _process_held
    with _process_lock:
        _process_held = max(0, _process_held - 1)


# -- this process's capacity: the long-held requests its stream loop serves (a descriptor and a few KB each)

_capacity_held: dict[str, int] = {}  # caller -> its long-held requests this process serves on its stream loop
_descriptors: tuple[int, int] | None = None  # (pid, this process's open-files limit, raised once to its hard one)
DESCRIPTORS_AT_MOST = 65536  # the open-files limit a process raises its own to, at most


def descriptors() -> int:
    """This process's open-files limit, its soft limit raised (once) to its hard one, at most
    :data:`DESCRIPTORS_AT_MOST`: each open stream or wait holds a socket."""
    global _descriptors
    if _descriptors is None or _descriptors[0] != os.getpid():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = min(hard if hard != resource.RLIM_INFINITY else DESCRIPTORS_AT_MOST, DESCRIPTORS_AT_MOST)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
                soft = wanted
            except (ValueError, OSError) as exc:
                log.warning("open-files limit not raised (%s)", exc)
        _descriptors = (os.getpid(), soft if soft != resource.RLIM_INFINITY else DESCRIPTORS_AT_MOST)
    return _descriptors[1]


def capacity() -> int:
    """How many long-held requests this process serves on its stream loop at most, whoever holds them."""
    return settings.open_per_process(descriptors())


def fair_part(name: str, most: int | None = None) -> int:
    """The most of this process's capacity (``most``) caller ``name`` may hold now: an equal part among the
    callers holding some here (``name`` counted), or three quarters when it is alone."""
    most = capacity() if most is None else most
    holders = {caller for caller, held in _capacity_held.items() if held > 0} | {name}
    return max(1, most * 3 // 4 if len(holders) == 1 else most // len(holders))


def _enter_capacity(name: str, kind: str) -> None:
    """Count a long-held request of caller ``name`` served by the stream loop; 429 past the process's
    capacity or the caller's fair part of it."""
    most = capacity()
    with _process_lock:
        total = sum(_capacity_held.values())
        mine = _capacity_held.get(name, 0)
        part = fair_part(name, most)
        if total < most and mine < part:
            _capacity_held[name] = mine + 1
            return
    if total >= most:
        raise _server_full(kind, total, most, f"This server already serves {most} waits and event streams, "
                                              "all it has room for")
    raise _server_full(kind, mine, part, f"This caller already holds {mine} waits and event streams on this "
                                         "server, its fair part of it beside the other callers")


def _leave_capacity(name: str) -> None:
    with _process_lock:
        left = _capacity_held.get(name, 0) - 1
        if left > 0:
            _capacity_held[name] = left
        else:
            _capacity_held.pop(name, None)


@dataclass(eq=False)
class Slot:
    """One long-held request's place in its caller's open share (and in this process's threads or capacity);
    renewed by this process while it is held (:func:`renew_all`), :meth:`release` once (again is harmless)."""

    caller: str
    member: str
    lease_s: float
    renewed: float = 0.0
    in_process: bool = False
    in_capacity: bool = False
    released: bool = False

    def renew(self) -> None:
        """Renew this one slot now (:func:`renew_all` renews every held slot together)."""
        _renew([self])

    def release(self) -> None:
        with _held_lock:
            if self.released:
                return
            self.released = True
            _held.discard(self)
        if self.in_process:
            _leave_process()
        if self.in_capacity:
            _leave_capacity(self.caller)
        where = counts()
        if where.client is None:
            with where.lock:
                where.local.get(self.caller, {}).pop(self.member, None)
            return
        try:
            where.client.zrem(_open_key(self.caller), self.member)
        except redis.RedisError as exc:
            log.warning("open slot not released, its lease will lapse (Redis: %s)", exc)


# -- renewing: one thread per process renews every slot it holds, whatever their clients do

_held: set[Slot] = set()
_held_lock = threading.Lock()
_renewer: tuple[int, threading.Thread] | None = None


def held_slots() -> int:
    """How many slots this process holds now."""
    with _held_lock:
        return len(_held)


def _hold(slot: Slot) -> None:
    global _renewer
    with _held_lock:
        _held.add(slot)
        if _renewer is None or _renewer[0] != os.getpid() or not _renewer[1].is_alive():
            thread = threading.Thread(target=_renew_forever, name="voice-tools-slot-renewer", daemon=True)
            _renewer = (os.getpid(), thread)
            thread.start()
        elif _period(slot) < RENEW_EVERY_S:  # a short lease: the renewer recounts its period now
            _renew_soon.set()


_renew_soon = threading.Event()


def _period(slot: Slot) -> float:
    return min(RENEW_EVERY_S, slot.lease_s / 4)


def _renew_forever() -> None:
    """Renew every held slot each ``RENEW_EVERY_S`` (a quarter of the shortest lease, if shorter)."""
    while True:
        with _held_lock:
            period = min([RENEW_EVERY_S, *(_period(slot) for slot in _held)])
        if _renew_soon.wait(period):
            _renew_soon.clear()
            continue
        try:
            renew_all()
        except Exception:  # never let the renewer die: a lapsed lease would let a caller past its share
            log.exception("open slots not renewed")


def renew_all() -> None:
    """Renew every slot this process holds (one round trip to Redis for all, one command per caller)."""
    with _held_lock:
        slots = list(_held)
    _renew(slots)


def _renew(slots: list[Slot]) -> None:
    if not slots:
        return
    where = counts()
    now = time.monotonic()
    if where.client is None:
        with where.lock:
            for slot in slots:
                held = where.local.get(slot.caller, {})
                if slot.member in held:
                    held[slot.member] = now + slot.lease_s
                slot.renewed = now
        return
    try:
        by_caller: dict[tuple[str, float], list[str]] = {}
        for slot in slots:
            by_caller.setdefault((slot.caller, slot.lease_s), []).append(slot.member)
        pipe = where.client.pipeline(transaction=False)
        for (caller, lease_s), members in by_caller.items():  # one command per caller (and lease)
            where.renew(keys=[_open_key(caller)], args=[lease_s, *members], client=pipe)
        pipe.execute()
        for slot in slots:
            slot.renewed = now
    except redis.RedisError as exc:
        log.warning("open slots not renewed (Redis: %s)", exc)


def _open_key(name: str) -> str:
    return f"{KEY_PREFIX}:open:{name}"


def take_slot(name: str, kind: str, limit: int | None = None, lease_s: float = LEASE_S,
              holds_thread: bool = True) -> Slot:
    """A slot of caller ``name``'s open share for a long-held request (``kind``: ``wait`` or
    ``stream``); :class:`ApiError` 429 ``too_many_open`` when it holds ``limit`` (its share) already.
    A request that ``holds_thread`` counts against this process's threads too; one that holds none (served
    by the process's stream loop, or MCP's event loop) against this process's capacity and the caller's
    fair part of it (``details.scope`` ``server`` when that refuses it)."""
    limit = limit if limit is not None else share_of(name).open
    slot = Slot(name, uuid.uuid4().hex, lease_s, time.monotonic())
    if holds_thread:
        slot.in_process = _enter_process(kind)
    else:
        _enter_capacity(name, kind)
        slot.in_capacity = True
    try:
        taken = _take_share(slot, name, kind, limit, lease_s)
    except BaseException:
        if slot.in_process:
            _leave_process()
        if slot.in_capacity:
            _leave_capacity(name)
        raise
    _hold(taken)
    return taken


def _take_share(slot: Slot, name: str, kind: str, limit: int, lease_s: float) -> Slot:
    where = counts()
    if where.client is None:
        with where.lock:
            held = where.local.setdefault(name, {})
            now = time.monotonic()
            for member in [m for m, end in held.items() if end <= now]:
                del held[member]
            taken = len(held) + 1 if len(held) < limit else -len(held)
            if taken > 0:
                held[slot.member] = now + lease_s
    else:
        try:
            taken = int(where.take(keys=[_open_key(name)], args=[limit, lease_s, slot.member]))
        except redis.RedisError as exc:
            log.warning("open slot not counted (Redis: %s)", exc)
            return slot
    if taken > 0:
        return slot
    retry_after = _retry_after(kind)
    raise ApiError(429, "too_many_open",
                   f"This caller already holds {-taken} waits and event streams open, its share at once; "
                   f"close one or try again in {retry_after} s.",
                   {"kind": kind, "open": -taken, "limit": limit, "retry_after": retry_after},
                   {"Retry-After": str(retry_after)})


def asks_to_wait(query: Any) -> bool:
    """Does a request's query (or an MCP tool's arguments) ask to wait (a ``wait`` given, not empty)?"""
    return isinstance(query, dict) and query.get("wait") not in (None, "", 0)


def wait_slot(name: str, wait: Any, holds_thread: bool = True) -> Slot:
    """A slot for a request that asks to wait ``wait`` seconds (checked first: 422 if it is not a valid
    wait); :class:`ApiError` 429 ``too_many_open`` when caller ``name``'s open share (or, if it
    ``holds_thread`` of this process's web threads, this process's) is full: the request is refused before
    it does anything, and the relay sends it again after ``Retry-After``."""
    from tasks.calls import schemas

    schemas.load(schemas.WaitQuery, {"wait": wait})
    return take_slot(name, "wait", holds_thread=holds_thread)
