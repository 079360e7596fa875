"""Is a call's chain still alive? The facts the stuck-call sweep judges by.

While a call's chain lives, one of its links is a message somewhere: waiting in its
tool's queue (a backlog may hold it there for long), delivered to a worker (running,
prefetched, or held until the ETA of a retry), or unacknowledged by a worker that died
(the broker gives it back). Links are acknowledged late, after the next one (or the
retry) was published, so a running chain never has a moment with no message; the
moment between a confirm (or a resume, or a redrive) and its publish is far shorter
than a time limit. A call EXECUTING with no link message anywhere, quiet past its links'
hard time limit (quiet since a link passed a side effect's gate or recorded its step,
``step_started_at``, or a later confirm, resume or redrive: ``queries.quiet_for``), has lost its chain: that, and
not a quiet period, is "stuck". A link seen running is left to its own time limits
(Celery's soft and hard limits and ``Link.on_failure``), never failed from here.

The facts, read cheaply (only when some call is overdue, and only its tools' queues):

- the workers, through Celery's remote control: ``inspect().active()``, ``reserved()``
  and ``scheduled()`` (a retry waiting for its countdown), by each request's first
  argument (the ``tool_call_id`` of every link);
- the broker. On Redis, in one transaction: the queue's lists (one per priority step)
  and the ``unacked`` hash (every message delivered and not acknowledged, by any
  worker, live or dead), decoded with kombu's own message class: that sees every
  message there is, so a queue read there is known completely (up to ``SCAN_LIMIT``
  waiting messages, read from the oldest end; past that it is not). On other transports
  (RabbitMQ) a waiting message cannot be read without taking it, only counted, and a
  delivered one is seen only through the worker holding it: each queue is asked on its own
  (``queue_declare(passive=True)``: its ready messages and its consumers), and it is known
  completely when nothing waits in it and every worker consuming it answered (as many
  answering workers consume it, by ``inspect().active_queues()``, as RabbitMQ counts
  consumers), never because one worker answered. A backlog, or a silent consumer, makes
  only its own queue "cannot tell". A link waiting for its countdown (a retry) waits in the
  broker's delay queues (Celery's native delayed delivery), where nothing says which queue it
  is for: while any message waits there, no queue is known completely.

A call seen nowhere whose queue is not known completely (the broker unreachable, a
backlog longer than ``SCAN_LIMIT``, or, on a broker whose messages cannot be read, a
backlog or a consumer that did not answer) is judged by the generous bound
``VOICE_TOOLS_STUCK_EXECUTING_AFTER`` alone. A Redis worker moves a message from the
queue to ``unacked`` in two steps; a call seen nowhere is read a second time a moment
later before it is judged stuck.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from kombu.serialization import prepare_accept_content
from kombu.transport.native_delayed_delivery import MAX_NUMBER_OF_BITS_TO_USE, level_name
from kombu.utils.json import loads

from models import db, queries
from models.calls import ToolCall
from tasks import chains, tools
from tasks.tools import Tool

log = logging.getLogger(__name__)

INSPECT_TIMEOUT_S = 1.0
RECHECK_AFTER_S = 1.0
# at most this many waiting messages of a queue are read per sweep (a huge backlog is not copied)
SCAN_LIMIT = 10_000
# where RabbitMQ keeps a message published with a countdown until it is due (Celery's native delayed delivery)
DELAY_QUEUES = tuple(level_name(level) for level in range(MAX_NUMBER_OF_BITS_TO_USE))


@dataclass(frozen=True)
class Facts:
    """Where links were seen, by ``tool_call_id``; which queues were seen completely; how many workers answered
    every question."""

    seen: Mapping[str, frozenset[str]]
    complete: frozenset[str]
    workers: int

    def lost(self, tool_call_id: str, queue: str) -> bool | None:
        """True: no link of the call anywhere; False: a link was seen; None: cannot tell."""
        if tool_call_id in self.seen:
            return False
        return True if queue in self.complete else None


@dataclass(frozen=True)
class Stuck:
    """A call whose chain is judged lost, and the quiet period that judgement rests on (for the
    compare-and-set statements that deal with it)."""

    call: ToolCall
    tool: Tool
    quiet_s: int


def time_limit_s(tool: Tool) -> int:
    """The longest a link of ``tool`` may run: its hard time limit, as its tasks declare it."""
    return max(int(link.time_limit or 0) for link in chains.LINKS[tool.name])


def read(app: Any, queues: Iterable[str]) -> Facts:
    """The facts about ``queues`` now (see the module's docstring)."""
    seen: dict[str, set[str]] = defaultdict(set)
    queues = sorted(set(queues))
    try:
        with app.connection_for_read() as conn:
            conn.ensure_connection(timeout=1, **chains.QUICK_RETRY)
            channel = conn.default_channel
            on_redis = _is_redis(channel)
            if on_redis:
                complete = _read_redis(channel, queues, prepare_accept_content(app.conf.accept_content), seen)
            else:
                depths = _read_depths(conn, queues)
    except Exception as exc:  # the broker cannot be read: nothing is known
        log.warning("stuck-call facts: the broker cannot be read (%s)", exc)
        return Facts({}, frozenset(), 0)
    consumed = _ask_workers(app, seen, ask_queues=not on_redis)
    if not on_redis:  # delivered messages are seen only through the workers: all of a queue's must answer
        complete = {q for q in queues if q in depths and depths[q][0] == 0
                    and sum(q in queues_of for queues_of in consumed.values()) >= depths[q][1]}
        if any(depths.get(q, (1, 0))[0] for q in DELAY_QUEUES):  # a countdown waits, for a queue not named
            complete = set()
    return Facts({k: frozenset(v) for k, v in seen.items()}, frozenset(complete), len(consumed))


def _read_depths(conn: Any, queues: list[str]) -> dict[str, tuple[int, int]]:
    """``queue -> (ready messages, consumers)`` as the broker counts them, for ``queues`` and the
    delay queues, each asked on its own (a passive declare of a queue the broker does not have
    closes the channel: a tool queue is then left out, unknown; a delay queue that is not there
    holds nothing; the next is asked on a new channel)."""
    depths = {}
    channel = conn.channel()
    try:
        for queue in [*queues, *DELAY_QUEUES]:
            try:
                declared = channel.queue_declare(queue=queue, passive=True)
            except conn.channel_errors as exc:
                if queue in DELAY_QUEUES:
                    depths[queue] = (0, 0)
                else:
                    log.warning("stuck-call facts: queue %s cannot be read (%s)", queue, exc)
                channel = conn.channel()
                continue
            depths[queue] = (declared.message_count, declared.consumer_count)
    finally:
        channel.close()
    return depths


def _is_redis(channel: Any) -> bool:
    """kombu's Redis channel: its queues are lists and its delivered messages a hash, all readable."""
    return hasattr(channel, "unacked_key") and hasattr(channel, "_q_for_pri")


def _read_redis(channel: Any, queues: list[str], accept: Any, seen: dict[str, set[str]]) -> set[str]:
    """The messages waiting in ``queues`` and every unacknowledged one, in one transaction; the
    queues read completely. A queue longer than :data:`SCAN_LIMIT` is read from its oldest end
    (the overdue calls wait there) only that far, and is not known completely."""
    lists = [(queue, channel._q_for_pri(queue, priority)) for queue in queues for priority in channel.priority_steps]
    with channel.conn_or_acquire() as client:
        with client.pipeline(transaction=True) as pipe:
            for _, key in lists:
                pipe.llen(key).lrange(key, -SCAN_LIMIT, -1)  # consumers pop the right end: the oldest
            pipe.hvals(channel.unacked_key)
            *replies, unacked = pipe.execute()
    complete = set(queues)
    waiting = []
    for (queue, _), length, items in zip(lists, replies[0::2], replies[1::2]):
        waiting += items
        if length > len(items):
            complete.discard(queue)
    for where, payloads in (("queued", [loads(raw) for raw in waiting]),
                            ("unacked", [loads(raw)[0] for raw in unacked])):
        for payload in payloads:
            tool_call_id = _call_of(channel, payload, accept)
            if tool_call_id:
                seen[tool_call_id].add(where)
    return complete


def _call_of(channel: Any, payload: dict[str, Any], accept: Any) -> str | None:
    """The ``tool_call_id`` a link message carries (its first argument); None for other messages."""
    try:
        message = channel.Message(payload, channel=channel, accept=accept)
        if not str((message.headers or {}).get("task", "")).startswith("tools."):
            return None
        body = message.decode()
        args = body.get("args") if isinstance(body, dict) else body[0]  # protocol 1, protocol 2
        return str(args[0]) if args else None
    except Exception:  # not a message of ours, or one this process cannot decode: not a link
        return None


def _ask_workers(app: Any, seen: dict[str, set[str]], ask_queues: bool = False) -> dict[str, frozenset[str]]:
    """Add the links the workers hold (running, prefetched, waiting for an ETA); the workers that
    answered every question, each with the queues it consumes (``ask_queues``; else none).

    An inspect waits its whole timeout for replies (it cannot know how many workers there are), so
    the questions are asked at once, each from a thread of its own (kombu gives each thread its own
    reply queue): one timeout per sweep, not one per question."""
    inspect = app.control.inspect(timeout=INSPECT_TIMEOUT_S)
    asks = {"active": inspect.active, "reserved": inspect.reserved, "scheduled": inspect.scheduled}
    if ask_queues:
        asks["queues"] = inspect.active_queues
    with ThreadPoolExecutor(max_workers=len(asks), thread_name_prefix="inspect") as pool:
        pending = {where: pool.submit(ask) for where, ask in asks.items()}
    answers: dict[str, int] = defaultdict(int)
    consumes: dict[str, frozenset[str]] = {}
    for where, future in pending.items():
        try:
            replies = future.result() or {}
        except Exception as exc:
            log.warning("stuck-call facts: inspect %s failed (%s)", where, exc)
            continue
        for worker, requests in replies.items():
            answers[worker] += 1
            if where == "queues":
                consumes[worker] = frozenset(q.get("name") for q in requests or () if isinstance(q, dict))
                continue
            for request in requests or ():
                request = request.get("request", request)  # scheduled entries wrap the request
                args = request.get("args") or ()
                if str(request.get("name", "")).startswith("tools.") and args and isinstance(args, (list, tuple)):
                    seen[str(args[0])].add(where)
    return {worker: consumes.get(worker, frozenset()) for worker, n in answers.items() if n == len(asks)}


# -- the judgement -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Overdue:
    """A call EXECUTING quiet past its links' hard time limit (``limit_s``); ``generous_s`` is the
    bound it is judged by when the facts cannot tell (never below ``limit_s``)."""

    call: ToolCall
    tool: Tool
    limit_s: int
    generous_s: int
    past_generous: bool


def overdue(fallback_s: int) -> list[Overdue]:
    """Calls EXECUTING quiet for longer than their links' time limit. Calls of a tool this process
    does not run are left alone."""
    limits = {name: time_limit_s(tool) for name, tool in tools.TOOLS.items()}
    if not limits:
        return []
    bounds = {*limits.values(), *(max(limit, fallback_s) for limit in limits.values())}
    with db.session() as s:
        quiet = {bound: set(queries.stuck_executing(s, bound)) for bound in bounds}
        found = []
        for tool_call_id in sorted(quiet[min(limits.values())]):
            call = queries.get(s, tool_call_id)
            tool = tools.get(call.function_name)
            if tool is None or tool_call_id not in quiet[limits[tool.name]]:
                continue
            generous = max(limits[tool.name], fallback_s)
            found.append(Overdue(call, tool, limits[tool.name], generous, tool_call_id in quiet[generous]))
    return found


def stuck(app: Any, fallback_s: int) -> list[Stuck]:
    """The calls whose chain is lost, judged by the facts; by ``fallback_s`` alone where they cannot tell."""
    candidates = overdue(fallback_s)
    if not candidates:
        return []
    queues = {c.tool.queue for c in candidates}
    facts = [read(app, queues)]
    if any(facts[0].lost(c.call.tool_call_id, c.tool.queue) for c in candidates):
        time.sleep(RECHECK_AFTER_S)  # a message between the queue and ``unacked`` is seen the second time
        facts.append(read(app, queues))
    found = []
    for c in candidates:
        verdicts = [f.lost(c.call.tool_call_id, c.tool.queue) for f in facts]
        if all(verdicts):
            found.append(Stuck(c.call, c.tool, c.limit_s))
        elif False not in verdicts and c.past_generous:
            found.append(Stuck(c.call, c.tool, c.generous_s))
        else:  # why an overdue call is left alone: where its link was seen, or that the facts could not tell
            seen = sorted({where for f in facts for where in f.seen.get(c.call.tool_call_id, ())})
            log.info("stuck-call facts: %s (%s at %s) is quiet past its links' time limit and left alone: %s",
                     c.call.tool_call_id, c.tool.name, c.call.current_step,
                     f"its link is {', '.join(seen)}" if seen else f"queue {c.tool.queue} cannot be read whole")
    return found
