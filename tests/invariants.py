"""What must hold after any fault or load, checked on the database and at the relay.

One checker for every scenario of ``tests/test_faults.py`` and ``tests/test_load.py``
(and the state machine of ``tests/test_lifecycle.py``). :func:`check` reads every call
of the (per-test, truncated) tables once the system has settled (:func:`settle`) and
returns a :class:`Verdict` whose ``problems`` must be empty:

- every call is terminal or waiting for its caller (PENDING, PREPARED): none is left
  EXECUTING (or MODIFIED, which is never a stored status);
- every status history follows the state machine (:data:`ALLOWED`), in time order, and
  ends at the stored status;
- side effects == COMPLETED write calls, exactly once: one row of the local backend's
  table (``email_outbox``, ``calendar_events``, ``todo_tasks``: :data:`EFFECT_ROWS`) for each
  COMPLETED call of its tool, none for any other call;
- no call is CANCELLED with ``committed_at`` set;
- every ended call says its outcome (done, not_done, unconfirmed), no open call does;
- what the API answered agrees with the rows: a call whose cancel answered 200 is
  CANCELLED (``answered_cancelled``);
- with a relay: every callback row was delivered, the relay received every event_id
  (and no other), each with the seq of its row, and a call's events, ordered by seq
  as docs/relay-guide.md tells a relay to, are 1, 2, 3 ... with no gap, its terminal event
  last. Delivery is at least once (docs/promises.md, 'Events and their order'): the relay may see an event_id
  twice (counted in ``relay_duplicates``) unless the scenario says ``once_at_relay``.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

from sqlalchemy import func, select

from models import db
from models.calendar import CalendarEvent
from models.calls import CANCELLED, COMPLETED, EXECUTING, PENDING, PREPARED, TERMINAL, CallbackDelivery, ToolCall
from models.email import EmailOutbox
from models.lifecycle import REDRIVEN_REASON
from models.task_list import TodoTask

# Every status change docs/promises.md allows (EXECUTING -> PENDING is the undo of a
# confirm whose chain the broker refused; EXECUTING -> EXECUTING is the stuck-call
# sweep running a committed chain again, with REDRIVEN_REASON).
ALLOWED = {
    "PENDING": {"MODIFIED", "EXECUTING", "CANCELLED", "EXPIRED"},
    "MODIFIED": {"PENDING"},
    "EXECUTING": {"PREPARED", "COMPLETED", "FAILED", "CANCELLED", "PENDING"},
    "PREPARED": {"EXECUTING", "CANCELLED", "EXPIRED"},
}
WAITING = (PENDING, PREPARED)
# the side effect of each write tool: a row of its local backend's table, by tool_call_id
EFFECT_ROWS = {"send_email": EmailOutbox, "schedule_meeting": CalendarEvent, "create_task": TodoTask}
TERMINAL_EVENTS = {"completed", "failed", "cancelled", "expired"}
# the entries that note an action which changes no status (the call's status as it was): run again, redelivered
NOTES = {"run_again_as", "redelivered"}


def history_problems(call: ToolCall) -> list[str]:
    """What is wrong with the call's ``status_history`` (empty: nothing)."""
    history = call.status_history
    statuses = [entry["status"] for entry in history]
    where = f"{call.tool_call_id} {' -> '.join(statuses)}"
    problems = []
    if not history or statuses[0] != PENDING:
        problems.append(f"history does not start PENDING: {where}")
    if any(not {"status", "at", "reason"} <= set(entry) for entry in history):
        problems.append(f"history entry without status, at or reason: {where}")
    times = [datetime.fromisoformat(entry["at"]) for entry in history if "at" in entry]
    if times != sorted(times):
        problems.append(f"history out of time order: {where}")
    changes = [entry for entry in history if not NOTES & set(entry)]  # a note changes no status
    for before, after in zip(changes, changes[1:]):
        redrive = before["status"] == after["status"] == EXECUTING and after.get("reason") == REDRIVEN_REASON
        if after["status"] not in ALLOWED.get(before["status"], set()) and not redrive:
            problems.append(f"{before['status']} -> {after['status']} not allowed: {where}")
    if statuses and statuses[-1] != call.status:
        problems.append(f"history ends {statuses[-1]} but the call is {call.status}: {where}")
    return problems


@dataclass
class Verdict:
    calls: int = 0
    statuses: Counter = field(default_factory=Counter)
    side_effects: int = 0
    events: int = 0
    relay_received: int = 0
    relay_duplicates: int = 0
    out_of_seq_arrivals: int = 0  # calls whose events did not arrive in seq order (allowed: seq orders them)
    failures: Counter = field(default_factory=Counter)  # FAILED calls by error_message
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.calls} calls {dict(sorted(self.statuses.items()))}, {self.side_effects} side effects, "
                f"{self.events} events, relay received {self.relay_received} "
                f"({self.relay_duplicates} duplicates, {self.out_of_seq_arrivals} calls out of seq order), "
                f"{len(self.problems)} problems" + (f"; failed: {dict(self.failures)}" if self.failures else ""))


def _open_work() -> tuple[int, int]:
    """(calls EXECUTING, callback deliveries still pending)."""
    with db.session() as s:
        executing = s.scalar(select(func.count()).select_from(ToolCall).where(ToolCall.status == EXECUTING))
        pending = s.scalar(select(func.count()).select_from(CallbackDelivery).where(
            CallbackDelivery.state == "pending", CallbackDelivery.url.is_not(None)))
    return executing, pending


def settle(timeout: float) -> None:
    """Wait until no call is EXECUTING and no delivery is pending (a timeout leaves it to :func:`check`)."""
    deadline = time.monotonic() + timeout
    while any(_open_work()) and time.monotonic() < deadline:
        time.sleep(0.25)


def check(relay: Any = None, *, once_at_relay: bool = False,
          answered_cancelled: Iterable[str] = ()) -> Verdict:
    """Check every call now in the tables (see the module's docstring)."""
    verdict = Verdict()
    with db.session() as s:
        calls = list(s.scalars(select(ToolCall)))
        effects = {name: Counter(s.scalars(select(table.tool_call_id).where(table.tool_call_id.is_not(None))))
                   for name, table in EFFECT_ROWS.items()}
        deliveries = list(s.scalars(select(CallbackDelivery).order_by(CallbackDelivery.tool_call_id,
                                                                      CallbackDelivery.seq)))
    verdict.calls = len(calls)
    verdict.side_effects = sum(sum(rows.values()) for rows in effects.values())
    problems = verdict.problems
    by_id = {call.tool_call_id: call for call in calls}
    for call in calls:
        verdict.statuses[call.status] += 1
        if call.status == "FAILED":
            verdict.failures[call.error_message] += 1
        where = f"{call.tool_call_id} ({call.function_name}, {call.status}, step {call.current_step})"
        if call.status not in TERMINAL and call.status not in WAITING:
            problems.append(f"neither terminal nor waiting: {where}")
        problems.extend(history_problems(call))
        if call.status == CANCELLED and call.committed_at is not None:
            problems.append(f"CANCELLED with committed_at {call.committed_at}: {where}")
        if (call.outcome is None) == (call.status in TERMINAL):  # docs/promises.md, "Exactly once"
            problems.append(f"outcome {call.outcome!r} for a call {call.status}: {where}")
        for name, rows in effects.items():
            made = rows.get(call.tool_call_id, 0)
            if call.function_name == name and call.status == COMPLETED:
                if made != 1:
                    problems.append(f"COMPLETED with {made} {EFFECT_ROWS[name].__tablename__} rows: {where}")
            elif made:
                problems.append(f"{made} {EFFECT_ROWS[name].__tablename__} rows but not a COMPLETED {name}: "
                                f"{where} {call.error_message!r}")
    for name, rows in effects.items():
        for stray in set(rows) - set(by_id):
            problems.append(f"a {EFFECT_ROWS[name].__tablename__} row for no call: {stray}")
    for tool_call_id in answered_cancelled:
        if by_id[tool_call_id].status != CANCELLED:
            problems.append(f"cancel answered 200 but the call is {by_id[tool_call_id].status}: {tool_call_id}")
    verdict.events = len(deliveries)
    if relay is not None:
        _check_relay(verdict, relay, [d for d in deliveries if d.url], once_at_relay)
    return verdict


def _check_relay(verdict: Verdict, relay: Any, deliveries: list[CallbackDelivery], once_at_relay: bool) -> None:
    problems = verdict.problems
    with relay._lock:
        received = list(relay.events)
    verdict.relay_received = len(received)
    seen: dict[str, list[dict[str, Any]]] = defaultdict(list)
    arrivals: dict[str, list[int]] = defaultdict(list)
    for event in received:
        if not seen[event["event_id"]]:
            arrivals[event["tool_call_id"]].append(event["seq"])
        seen[event["event_id"]].append(event)
    verdict.relay_duplicates = sum(len(copies) - 1 for copies in seen.values())
    verdict.out_of_seq_arrivals = sum(order != sorted(order) for order in arrivals.values())
    if once_at_relay:
        twice = [event_id for event_id, copies in seen.items() if len(copies) > 1]
        if twice:
            problems.append(f"{len(twice)} events received more than once, e.g. {twice[:3]}")
    rows = {d.event_id: d for d in deliveries}
    for event_id in set(seen) - set(rows):
        problems.append(f"the relay received an event that is no row: {event_id}")
    by_call: dict[str, list[CallbackDelivery]] = defaultdict(list)
    for d in deliveries:
        by_call[d.tool_call_id].append(d)
        where = f"{d.tool_call_id} {d.event} seq {d.seq} ({d.state}, {d.attempts} attempts, {d.last_error})"
        if d.state != "delivered":
            problems.append(f"not delivered: {where}")
        copies = seen.get(d.event_id, [])
        if not copies:
            problems.append(f"never received: {where}")
        elif {c["seq"] for c in copies} != {d.seq}:
            problems.append(f"received with seq {sorted({c['seq'] for c in copies})}: {where}")
    for tool_call_id, rows_of_call in by_call.items():
        seqs = sorted(seen[d.event_id][0]["seq"] for d in rows_of_call if seen.get(d.event_id))
        if seqs != list(range(1, len(rows_of_call) + 1)):
            problems.append(f"seqs received {seqs}, rows {len(rows_of_call)}: {tool_call_id}")
        terminal = [d.seq for d in rows_of_call if d.event in TERMINAL_EVENTS]
        if len(terminal) > 1 or (terminal and terminal[0] != max(d.seq for d in rows_of_call)):
            problems.append(f"terminal events at seqs {terminal} of {len(rows_of_call)}: {tool_call_id}")
