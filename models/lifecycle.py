"""The state machine: the only code that writes a call's ``status`` or ``committed_at``.

Every transition is one conditional ``UPDATE ... WHERE status IN (...) RETURNING``
that also appends to ``status_history``. ``event_seq`` counts the call's recorded
callback events (1, 2, 3 ... with no gaps), taken by the statement that inserts the event
(a transition's ``event=``, or :func:`record_event` after one). A transition that does not apply changes
nothing and raises :class:`Refused` naming the status it found, so the caller can
answer 404 or 409 without a second guess. Callers own the transaction
(``with db.session() as s:``, or ``db.statement()`` where one statement is the whole
transaction) so the API can enqueue only after the commit. The hot paths (a link's
gate, its step with its event, the API's confirm and create) are one statement
each, built once with named parameters and run on the driver's cursor (``models/compiled.py``:
no per-execution work of SQLAlchemy's), returning rows; a link's event is inserted
by the transition's own statement (``event=``, described by ``models/events.py``: a
data-modifying CTE that also takes the event's number).

Reading a call, and what the sweeps select, is ``models/queries.py``'s; the session
context is ``models/session_context.py``'s.
"""
from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any, Callable, Iterable

from sqlalchemy import (
    ColumnElement,
    Connection,
    Integer,
    Row,
    and_,
    any_,
    bindparam,
    case,
    cast,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, insert
from sqlalchemy.orm import Session, object_session
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.types import Float, Interval, String, Text

from models.calls import (
    CANCELLED,
    COMPLETED,
    DONE,
    EXECUTING,
    EXPIRED,
    FAILED,
    MODIFIED,
    NOT_DONE,
    PENDING,
    PREPARED,
    TERMINAL,
    UNCONFIRMED,
    ToolCall,
)
from models import link_attempts
from models.compiled import Compiled
from models.db import Executor
from models.events import Event
import voice_tools_tracing as tracing
from models.queries import get, quiet_for, stale_where

CANCELLABLE = (PENDING, MODIFIED, EXECUTING, PREPARED)
# Who acted, on the history entry of an action: ``by`` (a token's name, the operator's user on the
# CLI, a sweep's name for beat) and ``via``, the face it came through (``models.calls.FACES``).
# A transition the chain makes itself (a checkpoint, a completion) has neither.
Acted = dict[str, str]
EXPIRY_SWEEP: Acted = {"by": "expiry sweep", "via": "beat"}
STUCK_SWEEP: Acted = {"by": "stuck-call sweep", "via": "beat"}
# An entry's reason says what was done; who did it is its ``by`` and ``via`` (none: the chain itself).
# A caller's own cancel speaks for its user (the default promised to relays); an operator's says so.
DEFAULT_CANCEL_REASON = "Cancelled by user"
OPERATOR_CANCEL_REASON = "Cancelled by an operator"
CONFIRMED_REASON = "Confirmed"
PROCEEDED_REASON = "Proceeded from its checkpoint"
EXPIRED_REASON = "Expired unanswered"


class IdTaken(Exception):
    """A relay-given ``tool_call_id`` that another caller's call already has: answered as a
    conflict that tells nothing of that call (not even that it exists beyond the id)."""

    def __init__(self, tool_call_id: str):
        super().__init__(f"The tool_call_id {tool_call_id!r} is already in use; give another one (or none).")
        self.tool_call_id = tool_call_id


class Refused(Exception):
    """A transition that does not apply to the call as it is now.

    ``code`` is one of ``invalid_status``, ``too_late``, ``already_terminal``,
    ``idempotency_conflict``; ``call`` is the row as found.
    """

    def __init__(self, code: str, call: ToolCall, message: str):
        super().__init__(message)
        # The caller's transaction rolls back when this propagates, and a rollback
        # expires every instance still in the session: detach the row as found so
        # ``exc.call`` stays readable after the ``with db.session()`` block.
        found_in = object_session(call) if isinstance(call, ToolCall) else None  # a Core row is no session's
        if found_in is not None:
            found_in.expunge(call)
        self.code = code
        self.call = call
        self.status = call.status


def new_tool_call_id() -> str:
    return "tc_" + secrets.token_hex(6)


# -- SQL pieces ---------------------------------------------------------------

def _entry(status: str, reason: str | None, **extra: Any) -> dict[str, Any]:
    """A ``status_history`` entry; its ``at`` is added by the database (``_stamped``)."""
    item: dict[str, Any] = {"status": status, "reason": reason}
    item.update(extra)
    return item


# When the row is actually updated (after any wait for a concurrent transaction's
# lock), not when Python built the statement: so the history's ``at`` values are in
# the order the transitions happened.
_NOW_ISO = func.to_char(func.timezone("UTC", func.clock_timestamp()), 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')


def _stamped(entries: list[Any]) -> ColumnElement[Any]:
    """``[entries...]`` as JSONB, each entry (a dict, or a JSONB bind parameter) given ``at`` by the database."""
    return func.jsonb_build_array(*(
        (entry if isinstance(entry, BindParameter) else bindparam(None, entry, type_=JSONB))
        .op("||")(func.jsonb_build_object("at", _NOW_ISO))
        for entry in entries
    ))


def _append(column: Any, entries: list[dict[str, Any]]) -> ColumnElement[Any]:
    return column.op("||")(_stamped(entries))


def _elapsed_ms_since(start: ColumnElement[Any]) -> ColumnElement[Any]:
    elapsed = cast(func.round(func.extract("epoch", func.clock_timestamp() - start) * 1000), Integer)
    return func.coalesce(ToolCall.execution_time_ms, 0) + elapsed


def _attempt_added(attempt: dict[str, Any] | None, column: Any = ToolCall.link_attempts,
                   built_once: bool = True) -> dict[str, Any]:
    """The values that add a run's entry to ``link_attempts`` (none without one): as the parameter
    ``P_ATTEMPT`` in a statement built once (:func:`_transition_row`), else as the value itself."""
    if attempt is None:
        return {}
    item = P_ATTEMPT if built_once else bindparam(None, attempt, type_=JSONB)
    return {"link_attempts": link_attempts.appended(column, item)}


CALLS = ToolCall.__table__
# What the rows of a link's statements carry (its gate, its step's record, a checkpoint, the completion:
# several a call): the columns a link reads, no more. Every other column costs its conversion to text in
# PostgreSQL and its parsing here (a timestamp, a JSON document) on every such statement: 0.1 ms of a
# pool child's CPU a statement for the whole row. The histories above all grow with every transition.
LINK_COLUMNS = tuple(CALLS.c[name] for name in (
    "tool_call_id", "session_id", "caller", "function_name", "status", "current_step", "progress", "parameters",
    "step_outputs", "workflow_id", "event_seq", "effect_claimed_by", "effect_claimed_until", "effect_attempts"))


def _cas(
    tool_call_id: str,
    *,
    from_statuses: Iterable[str],
    to_status: str | None,
    reason: str | None = None,
    extra_where: Iterable[ColumnElement[bool]] = (),
    history: list[dict[str, Any]] | None = None,
    target: Any = CALLS,
    **values: Any,
) -> Any:
    """The compare-and-set ``UPDATE`` of one transition (without its RETURNING)."""
    if history is None:
        history = [_entry(to_status, reason)] if to_status else []
    if to_status:
        values["status"] = to_status
    if history:
        values["status_history"] = _append(ToolCall.status_history, history)
    statuses = tuple(from_statuses)
    # one status: a plain comparison (an IN list is rendered into the SQL again at every execution)
    status_is = ToolCall.status == statuses[0] if len(statuses) == 1 else ToolCall.status.in_(statuses)
    return (
        update(target)
        .where(ToolCall.tool_call_id == tool_call_id, status_is, *extra_where)
        .values(**values)
    )


def _transition(s: Session, tool_call_id: str, **transition: Any) -> ToolCall | None:
    """Apply one conditional update; return the new row (an ORM entity) or None if it did not apply."""
    stmt = _cas(tool_call_id, target=ToolCall, **transition).returning(ToolCall).execution_options(
        synchronize_session=False, populate_existing=True)
    return s.scalars(stmt).one_or_none()


# The hot paths' statements are built once per shape, with named bind parameters, and
# executed with the values (building a data-modifying CTE costs as much as running it).
P_ID = bindparam("p_id", type_=String)
P_STEP = bindparam("p_step", type_=String)
P_PROGRESS = bindparam("p_progress", type_=Float)
P_OUTPUT = bindparam("p_output", type_=JSONB)
P_HISTORY = bindparam("p_history", type_=JSONB)
P_RESULT = bindparam("p_result", type_=JSONB)
P_VOICE = bindparam("p_voice", type_=Text)
P_CONTEXT_KEY = bindparam("p_context_key", type_=String)
P_CHAIN = bindparam("p_chain", type_=String)
P_TOKEN = bindparam("p_token", type_=String)
P_LEASE = bindparam("p_lease", type_=Interval)
P_ATTEMPT = bindparam("p_attempt", type_=JSONB)
_BUILT: dict[tuple[Any, ...], Compiled] = {}


def _transition_row(s: Executor, key: tuple[Any, ...], params: dict[str, Any], make: Callable[[], Any],
                    event: Event | None = None, columns: tuple[Any, ...] = tuple(CALLS.c)) -> Row[Any] | None:
    """The hot paths' transition: one statement, a row of ``columns`` (no ORM entity), or None if
    it did not apply. Run on the driver's cursor (:class:`models.compiled.Compiled`).

    ``make()`` builds the transition's compare-and-set (with the ``P_*`` parameters), once
    per ``key`` and event shape; ``params`` are this run's values. With ``event``, the
    same statement takes the call's next event number (``event_seq``, on the row it has
    just locked) and inserts the event's callback row from the updated row (a
    data-modifying CTE): the returned row then also holds the columns the event's INSERT
    returns. A transition that does not apply inserts nothing.
    """
    # a statement that is its own transaction numbers its event in the stream's order itself
    numbered = event is not None and isinstance(s, Connection) and bool(s.connection.dbapi_connection.autocommit)
    shape = (key, event.shape if event is not None else None, numbered)
    built = _BUILT.get(shape)
    if built is None:
        cas = make()
        if event is None:
            stmt = cas.returning(*columns)
        else:
            moved = cas.values(event_seq=CALLS.c.event_seq + 1).returning(*CALLS.c).cte("moved")
            added = event.build(moved, numbered).cte("added")
            stmt = select(*(moved.c[c.name] for c in columns), added).select_from(moved.join(added, true()))
        built = _BUILT[shape] = Compiled(stmt)
    return built.one_or_none(s, {**params, **event.params} if event is not None else params)


def next_event_seq(s: Session, tool_call_id: str) -> int:
    """The number of the call's next callback event (1, 2, 3 ...), taken in the caller's transaction.

    The transition that causes an event has already locked the call's row in the same
    transaction, so two events of one call never take the same number, and an event
    rolled back gives its number back.
    """
    return s.execute(
        update(ToolCall).where(ToolCall.tool_call_id == tool_call_id)
        .values(event_seq=ToolCall.event_seq + 1).returning(ToolCall.event_seq)
        .execution_options(synchronize_session=False)
    ).scalar_one()



def record_event(s: Executor, tool_call_id: str, event: Event) -> Row[Any]:
    """Insert ``event`` for the call as it is now, in the caller's transaction (after a transition
    that did not insert it itself): one statement takes the call's next event number and
    inserts the event's row from the call's row (see :func:`_transition_row`)."""
    def make() -> Any:
        return update(CALLS).where(ToolCall.tool_call_id == P_ID)

    return _transition_row(s, ("record_event",), {"p_id": tool_call_id}, make, event)

def _owned_by(caller: str | None) -> list[ColumnElement[bool]]:
    """The rows a caller may see: its own; every row when ``caller`` is None (an operator)."""
    return [] if caller is None else [ToolCall.caller == caller]


def _refuse(s: Executor, tool_call_id: str, action: str, caller: str | None = None) -> Refused:
    """Build the reason a transition did not apply, from the row as it is now
    (:class:`models.queries.NotFound` if it is not ``caller``'s, when given)."""
    call = get(s, tool_call_id, caller)
    if call.status in TERMINAL:
        return Refused("already_terminal", call, f"Cannot {action}: the call is already {call.status}.")
    if call.committed_at is not None and action == "cancel":
        return Refused("too_late", call, "Too late to cancel: the action is already under way.")
    return Refused("invalid_status", call, f"Cannot {action} a call that is {call.status}.")


# -- creation -----------------------------------------------------------------

_CREATED_FROM = ("tool_call_id", "session_id", "connection_id", "intent_id", "idempotency_key", "function_name",
                 "action_level", "parameters", "callback_url", "callback_urls", "context_key", "caller",
                 "request_kind", "trace_context")
# built once: each column's value a parameter of the column's own type (as ``values(col=value)`` binds it)
_CREATE = Compiled(
    insert(CALLS)
    .values(status=PENDING, status_history=_stamped([P_HISTORY]),
            **{name: bindparam(f"c_{name}", type_=CALLS.c[name].type) for name in _CREATED_FROM})
    .on_conflict_do_nothing()
    .returning(*CALLS.c)
)

def create(
    s: Executor,
    *,
    session_id: str,
    function_name: str,
    action_level: str,
    parameters: dict[str, Any],
    tool_call_id: str | None = None,
    connection_id: str | None = None,
    intent_id: str | None = None,
    callback_url: str | None = None,
    callback_urls: dict[str, str] | None = None,
    idempotency_key: str | None = None,
    context_key: str | None = None,
    caller: str | None = None,
    reason: str | None = "Recorded",
    request_kind: str = "pending",
    acted: Acted | None = None,
) -> tuple[Row[Any], bool]:
    """Record a PENDING call (one statement); return ``(call, created)``, the call a Core row.

    A replay (same ``idempotency_key`` or ``tool_call_id`` of the same ``caller``: keys are
    per caller, and another caller's ``tool_call_id`` is :class:`IdTaken`; same session,
    tool and parameters, same ``request_kind``) returns the existing call with ``created=False``;
    the same key with other content, or on the other kind of request (a ``pending`` call
    replayed as ``execute`` would start a call nobody confirmed), raises
    :class:`Refused` ``idempotency_conflict``.
    """
    tool_call_id = tool_call_id or new_tool_call_id()
    values = {
        "tool_call_id": tool_call_id, "session_id": session_id, "connection_id": connection_id,
        "intent_id": intent_id, "idempotency_key": idempotency_key, "function_name": function_name,
        "action_level": action_level, "parameters": parameters, "callback_url": callback_url,
        "callback_urls": callback_urls or None, "context_key": context_key, "caller": caller,
        "request_kind": request_kind,
        "trace_context": tracing.traceparent(),  # the trace a later request about the call joins; None when off
    }
    call = _CREATE.one_or_none(s, {"p_history": _entry(PENDING, reason, **(acted or {})),
                                   **{f"c_{name}": value for name, value in values.items()}})
    if call is not None:
        tracing.remember(tool_call_id, values["trace_context"])  # a later request about it here reads no row
        return call, True
    clauses = [ToolCall.tool_call_id == tool_call_id]
    if idempotency_key:
        clauses.append(and_(ToolCall.idempotency_key == idempotency_key,
                            func.coalesce(ToolCall.caller, "") == (caller or "")))
    existing = s.execute(select(CALLS).where(or_(*clauses))
                         .order_by((ToolCall.tool_call_id == tool_call_id).desc())).first()
    if existing is None:  # the conflicting row vanished (deleted); let the caller retry
        raise RuntimeError("conflicting tool call disappeared")
    if (existing.caller or "") != (caller or ""):  # only a tool_call_id can clash across callers
        raise IdTaken(tool_call_id)
    same = (
        existing.session_id == session_id
        and existing.function_name == function_name
        and existing.parameters == parameters
    )
    if not same:
        raise Refused(
            "idempotency_conflict",
            existing,
            "This idempotency key or tool_call_id was already used for a different call.",
        )
    if existing.request_kind != request_kind:
        raise Refused(
            "idempotency_conflict",
            existing,
            f"This idempotency key or tool_call_id was already used on /{existing.request_kind}; "
            f"a replay must be the same kind of request, not /{request_kind}.",
        )
    return existing, False


# -- before execution ---------------------------------------------------------

def modify(
    s: Session, tool_call_id: str, *, old_parameters: dict[str, Any], new_parameters: dict[str, Any],
    changes: list[dict[str, Any]], caller: str | None = None, acted: Acted | None = None,
) -> ToolCall:
    """Replace the parameters of a PENDING call, compare-and-set on the parameters read.

    The caller merged and validated ``new_parameters`` from ``old_parameters``; if
    another modify got in between, the update does not apply and :class:`Refused`
    ``invalid_status`` is raised only when the call is no longer PENDING (otherwise
    ``stale`` so the caller may merge again). ``caller``: only that caller's call
    (another's is :class:`models.queries.NotFound`, checked by the same statement).
    """
    history_entries = [dict(change) for change in changes]
    row = _transition(
        s,
        tool_call_id,
        from_statuses=(PENDING,),
        to_status=PENDING,
        history=[
            _entry(MODIFIED, "Parameters changed", fields=[c["field"] for c in changes], **(acted or {})),
            _entry(PENDING, "Awaiting confirmation", **(acted or {})),
        ],
        extra_where=[ToolCall.parameters == bindparam(None, old_parameters, type_=JSONB), *_owned_by(caller)],
        parameters=new_parameters,
        parameters_history=_append(ToolCall.parameters_history, history_entries),
    )
    if row is not None:
        return row
    call = get(s, tool_call_id, caller)
    if call.status == PENDING:
        raise Refused("stale", call, "The parameters changed meanwhile.")
    raise _refuse(s, tool_call_id, "modify", caller)


_CONFIRM: dict[tuple[bool, ...], Compiled] = {}


def confirm(s: Executor, tool_call_id: str, reason: str = CONFIRMED_REASON, callback_url: str | None = None,
            callback_urls: dict[str, str] | None = None, caller: str | None = None,
            workflow_id: str | None = None, functions: Iterable[str] | None = None,
            acted: Acted | None = None) -> Row[Any]:
    """PENDING → EXECUTING (one statement; a Core row); a ``callback_url`` / ``callback_urls``
    given now replace the recorded ones.

    ``caller``: only that caller's call (another's is :class:`models.queries.NotFound`, checked by the same
    statement); ``workflow_id``: the id the chain will be enqueued with, recorded now;
    ``functions``: only a call of one of these tools (another stays PENDING: :class:`Refused`).
    """
    shape = (bool(callback_url), bool(callback_urls), bool(workflow_id), caller is not None, functions is not None)
    built = _CONFIRM.get(shape)
    if built is None:  # once per shape: which of the optional values and checks this confirm has
        values: dict[str, Any] = {"confirmed_at": func.now()}
        for given, name in zip(shape[:3], ("callback_url", "callback_urls", "workflow_id")):
            if given:
                values[name] = bindparam(f"p_{name}", type_=CALLS.c[name].type)
        where = [ToolCall.caller == bindparam("p_caller", type_=String)] if caller is not None else []
        if functions is not None:  # an array parameter: an IN list would be rendered again at every execution
            where.append(ToolCall.function_name == any_(bindparam("p_functions", type_=ARRAY(String))))
        built = _CONFIRM[shape] = Compiled(_cas(P_ID, from_statuses=(PENDING,), to_status=EXECUTING,
                                                history=[P_HISTORY], extra_where=where, **values)
                                           .returning(*CALLS.c))
    row = built.one_or_none(s, {
        "p_id": tool_call_id, "p_history": _entry(EXECUTING, reason, **(acted or {})), "p_callback_url": callback_url,
        "p_callback_urls": callback_urls, "p_workflow_id": workflow_id, "p_caller": caller,
        "p_functions": list(functions) if functions is not None else None})
    if row is None:
        raise _refuse(s, tool_call_id, "confirm", caller)
    return row


def unconfirm(s: Session, tool_call_id: str, reason: str = "Queue unavailable") -> ToolCall | None:
    """Undo a confirm whose chain could not be enqueued (no step has run yet).

    None when a link has begun: the publish reached the broker after all (only its answer
    was lost) and the chain is running.
    """
    return _transition(
        s, tool_call_id, from_statuses=(EXECUTING,), to_status=PENDING, reason=reason,
        extra_where=[ToolCall.current_step.is_(None), ToolCall.committed_at.is_(None)],
        confirmed_at=None, workflow_id=None,
    )


def cancel(s: Session, tool_call_id: str, reason: str | None = None, caller: str | None = None,
           acted: Acted | None = None) -> ToolCall:
    """Cancel while the point of no return has not been passed.

    ``caller``: only that caller's call (another's is :class:`models.queries.NotFound`, checked
    by the same statement); ``acted``: who asked, and through which face.
    """
    reason = reason or DEFAULT_CANCEL_REASON
    row = _transition(
        s, tool_call_id, from_statuses=CANCELLABLE, to_status=CANCELLED, history=[_entry(CANCELLED, reason, **(acted or {}))],
        extra_where=[ToolCall.committed_at.is_(None), *_owned_by(caller)],
        completed_at=func.now(), error_message=reason, outcome=NOT_DONE,
    )
    if row is None:
        raise _refuse(s, tool_call_id, "cancel", caller)
    return row


def set_voice_response(s: Session, tool_call_id: str, voice_response: str) -> ToolCall:
    """Store the sentence that tells how a call ended (no status change)."""
    return s.scalars(
        update(ToolCall).where(ToolCall.tool_call_id == tool_call_id).values(voice_response=voice_response)
        .returning(ToolCall).execution_options(synchronize_session=False, populate_existing=True)
    ).one()


# -- during execution (the chain's links) ---------------------------------------

def _claim_free() -> ColumnElement[bool]:
    """The side effect ``P_STEP`` may be claimed: not recorded done, and no live claim on it."""
    return and_(~ToolCall.step_outputs.has_key(P_STEP),
                or_(ToolCall.effect_claimed_until.is_(None), ToolCall.effect_claimed_until < func.now()))


def begin_step(s: Executor, tool_call_id: str, step: str, progress: float, commit: bool = False,
               chain: str | None = None, token: str | None = None, lease_s: float = 0.0) -> Row[Any] | None:
    """Gate a step that records its passage (the engine's side-effect steps; a step without side
    effect has a read for its gate, :func:`gate`): the call must still be EXECUTING, and, given its
    ``chain``, that chain must be the call's (``workflow_id``): a stale chain stops here. None means
    stop. Counts the runs of the step (``step_attempts``).

    ``commit``: the step has a side effect, and this same statement (the one that checks
    the call is EXECUTING) passes the point of no return, as :func:`commit_point` does, and
    claims the effect for ``token`` for ``lease_s`` seconds unless it is recorded done or
    another attempt holds a live claim: the caller holds the claim when the returned row's
    ``effect_claimed_by`` is its ``token``; ``effect_attempts`` counts the claims (more than
    one: an earlier attempt may have acted).
    """
    def make() -> Any:
        values: dict[str, Any] = {}
        if commit:
            take = _claim_free()
            values = {
                "committed_at": func.coalesce(ToolCall.committed_at, func.now()),
                "effect_claimed_until": case((take, func.now() + P_LEASE), else_=ToolCall.effect_claimed_until),
                "effect_claimed_by": case((take, P_TOKEN), else_=ToolCall.effect_claimed_by),
                "effect_attempts": case((take, ToolCall.effect_attempts + 1), else_=ToolCall.effect_attempts),
            }
        fence = [ToolCall.workflow_id == P_CHAIN] if chain is not None else []
        return _cas(
            P_ID, from_statuses=(EXECUTING,), to_status=None, history=[], extra_where=fence,
            current_step=P_STEP, progress=P_PROGRESS,
            executed_at=func.coalesce(ToolCall.executed_at, func.now()), step_started_at=func.now(),
            attempts=ToolCall.attempts + 1,
            step_attempts=case((ToolCall.current_step == P_STEP, ToolCall.step_attempts + 1), else_=1),
            **values,
        )

    params = {"p_id": tool_call_id, "p_step": step, "p_progress": progress, "p_chain": chain, "p_token": token,
              "p_lease": timedelta(seconds=lease_s)}
    return _transition_row(s, ("begin_step", commit, chain is not None), params, make, columns=LINK_COLUMNS)


_GATE: dict[bool, Compiled] = {}


def gate(s: Executor, tool_call_id: str, chain: str | None = None) -> Row[Any] | None:
    """The gate of a step without side effect: a read, no write. The call as it is, if it is EXECUTING
    and, given its ``chain``, that chain is the call's (``workflow_id``); None means stop. Nothing is
    claimed or counted: running such a step twice is harmless, and what it records is fenced by
    :func:`record_step` (once per step, by the call's chain, while EXECUTING)."""
    stmt = _GATE.get(chain is not None)
    if stmt is None:
        fence = [CALLS.c.workflow_id == P_CHAIN] if chain is not None else []
        stmt = _GATE[chain is not None] = Compiled(select(*LINK_COLUMNS).where(
            CALLS.c.tool_call_id == P_ID, CALLS.c.status == EXECUTING, *fence))
    return stmt.one_or_none(s, {"p_id": tool_call_id, "p_chain": chain})


def count_failed_run(s: Executor, tool_call_id: str, step: str, chain: str | None = None) -> int | None:
    """Count a failed run of ``step``, a step without side effect (its gate counted nothing), before
    it is retried: the call's runs of the step so far (``step_attempts``, the bound of its retries even
    when the broker refuses the retry's publish), or None if the call is no longer EXECUTING under
    ``chain`` (stop)."""
    fence = [CALLS.c.workflow_id == chain] if chain is not None else []
    return s.execute(
        update(CALLS).where(CALLS.c.tool_call_id == tool_call_id, CALLS.c.status == EXECUTING, *fence)
        .values(current_step=step, step_started_at=func.now(), attempts=CALLS.c.attempts + 1,
                executed_at=func.coalesce(CALLS.c.executed_at, func.now()),
                step_attempts=case((CALLS.c.current_step == step, CALLS.c.step_attempts + 1), else_=1))
        .returning(CALLS.c.step_attempts)
    ).scalar_one_or_none()


def add_attempt(s: Executor, tool_call_id: str, attempt: dict[str, Any]) -> None:
    """Add a link run's entry to the call's ``link_attempts`` (a retried run of a step without side
    effect: the statement that counted it could not yet say whether it is retried)."""
    s.execute(update(CALLS).where(CALLS.c.tool_call_id == tool_call_id)
              .values(**_attempt_added(attempt, CALLS.c.link_attempts, built_once=False)))


def take_over_claim(s: Executor, tool_call_id: str, step: str, held_by: str, token: str,
                    lease_s: float) -> Row[Any] | None:
    """Claim the side effect ``step`` for ``token`` from ``held_by``, an attempt known to have died
    (its process is gone) before its lease ended; None if the claim changed hands meanwhile, the
    step was recorded or the call is no longer EXECUTING. Counted as a claim: the new attempt
    knows an earlier one may have acted."""
    return s.execute(
        update(CALLS).where(CALLS.c.tool_call_id == tool_call_id, CALLS.c.status == EXECUTING,
                            CALLS.c.effect_claimed_by == held_by, ~CALLS.c.step_outputs.has_key(step))
        .values(effect_claimed_by=token, effect_claimed_until=func.now() + timedelta(seconds=lease_s),
                effect_attempts=CALLS.c.effect_attempts + 1)
        .returning(*CALLS.c)
    ).one_or_none()


def release_claim(s: Executor, tool_call_id: str, token: str, attempt: dict[str, Any] | None = None) -> None:
    """Give up the side effect's claim held by ``token`` (its attempt failed and will be retried:
    the retry claims it again, knowing an earlier attempt may have acted: a claim once counted in
    ``effect_attempts`` is never taken back, since no read can prove an attempt did not act).
    ``attempt``: the failed run's entry, added to ``link_attempts``."""
    s.execute(update(CALLS).where(CALLS.c.tool_call_id == tool_call_id, CALLS.c.effect_claimed_by == token)
              .values(effect_claimed_until=None, **_attempt_added(attempt, CALLS.c.link_attempts, built_once=False)))


def commit_point(s: Session, tool_call_id: str, step: str) -> ToolCall | None:
    """The point of no return: set ``committed_at`` if and only if still EXECUTING.

    A redelivered link finds ``committed_at`` already set and keeps it, so the side
    effect (which carries its own idempotency key) may be retried; a cancel that
    comes after this statement answers ``too_late``.
    """
    return _transition(
        s, tool_call_id, from_statuses=(EXECUTING,), to_status=None,
        history=[],
        current_step=step,
        committed_at=func.coalesce(ToolCall.committed_at, func.now()),
    )


# the step's output added to ``step_outputs`` under its name (``P_STEP``, ``P_OUTPUT``)
_WITH_OUTPUT = ToolCall.step_outputs.op("||")(func.jsonb_build_object(P_STEP, P_OUTPUT))


def record_step(s: Executor, tool_call_id: str, step: str, output: Any, progress: float,
                event: Event | None = None, chain: str | None = None, token: str | None = None,
                attempt: dict[str, Any] | None = None) -> Row[Any] | None:
    """Store a finished step's output (so a redelivery skips it) and its progress;
    with ``event``, its callback event in the same statement (see :func:`_transition_row`).

    ``token``: a side effect's, recorded only by the attempt that holds its claim, which the
    same statement releases; else (a step without side effect, whose gate was a read) only once,
    counted as a run of the call (``attempts``), and, given ``chain``, only while that chain is
    the call's. Either is the call's latest sign of life (``step_started_at``). ``attempt``: the
    run's entry, added to ``link_attempts`` (:mod:`models.link_attempts`)."""
    def make() -> Any:
        values: dict[str, Any] = {"step_started_at": func.now(), **_attempt_added(attempt)}
        fence: list[ColumnElement[bool]] = []
        if token is not None:
            fence = [ToolCall.effect_claimed_by == P_TOKEN]
            values["effect_claimed_until"] = None
        else:  # two copies of the link may both have run the step: the first records it
            fence = [~ToolCall.step_outputs.has_key(P_STEP)]
            values.update(attempts=ToolCall.attempts + 1, executed_at=func.coalesce(ToolCall.executed_at, func.now()))
            if chain is not None:
                fence.append(ToolCall.workflow_id == P_CHAIN)
        return _cas(P_ID, from_statuses=(EXECUTING,), to_status=None, history=[], extra_where=fence,
                    current_step=P_STEP, progress=P_PROGRESS, step_outputs=_WITH_OUTPUT, **values)

    return _transition_row(s, ("record_step", token is not None, chain is not None, attempt is not None),
                           {"p_id": tool_call_id, "p_step": step, "p_progress": progress, "p_output": output,
                            "p_chain": chain, "p_token": token, "p_attempt": attempt},
                           make, event, columns=LINK_COLUMNS)


def checkpoint(s: Executor, tool_call_id: str, step: str, progress: float, output: Any = None,
               event: Event | None = None, attempt: dict[str, Any] | None = None) -> Row[Any] | None:
    """EXECUTING → PREPARED: the chain ends here until resumed. ``output`` (the step's
    preview), when given, is stored as the step's output by the same statement; with
    ``event``, the ``checkpoint`` event is recorded by it too. Counted as a run of the call (``attempts``)."""
    def make() -> Any:
        values = {} if output is None else {"step_outputs": _WITH_OUTPUT}
        values.update(_attempt_added(attempt))
        return _cas(
            P_ID, from_statuses=(EXECUTING,), to_status=PREPARED, history=[P_HISTORY],
            current_step=P_STEP, progress=P_PROGRESS, prepared_at=func.now(), **values,
            attempts=ToolCall.attempts + 1, executed_at=func.coalesce(ToolCall.executed_at, func.now()),
            execution_time_ms=_elapsed_ms_since(func.coalesce(ToolCall.resumed_at, ToolCall.executed_at, ToolCall.confirmed_at)),
        )

    params = {"p_id": tool_call_id, "p_step": step, "p_progress": progress, "p_output": output,
              "p_history": _entry(PREPARED, f"Checkpoint {step}"), "p_attempt": attempt}
    return _transition_row(s, ("checkpoint", output is None, attempt is not None), params, make, event,
                           columns=LINK_COLUMNS)


def undo_resume(s: Session, tool_call_id: str, step: str | None, reason: str = "Queue unavailable") -> ToolCall | None:
    """EXECUTING → PREPARED at checkpoint ``step``: undo a resume whose chain could not be enqueued.

    Applies only while no later link has begun (``current_step`` is still the checkpoint)
    and the point of no return was not passed; otherwise the chain's publish reached the
    broker after all (only its answer was lost), the chain is running, and None says so.
    """
    return _transition(
        s, tool_call_id, from_statuses=(EXECUTING,), to_status=PREPARED, reason=reason,
        extra_where=[ToolCall.current_step.is_not_distinct_from(step), ToolCall.committed_at.is_(None)],
        workflow_id=None,  # the chain that was sent (if it was) is no longer the call's: it stops at its gate
    )


def resume(s: Session, tool_call_id: str, reason: str = PROCEEDED_REASON, caller: str | None = None,
           workflow_id: str | None = None, acted: Acted | None = None) -> ToolCall:
    """PREPARED → EXECUTING at the checkpoint. ``caller``: only that caller's call (another's is
    :class:`models.queries.NotFound`, checked by the same statement); ``workflow_id``: the id the
    rest of the chain will be sent with, recorded now (only that chain passes a gate)."""
    values = {"workflow_id": workflow_id} if workflow_id else {}
    row = _transition(
        s, tool_call_id, from_statuses=(PREPARED,), to_status=EXECUTING, history=[_entry(EXECUTING, reason, **(acted or {}))],
        extra_where=_owned_by(caller), resumed_at=func.now(), **values,
    )
    if row is None:
        raise _refuse(s, tool_call_id, "resume", caller)
    return row


def complete(s: Executor, tool_call_id: str, result: dict[str, Any], voice_response: str,
             context_key: str | None = None, event: Event | None = None,
             attempt: dict[str, Any] | None = None) -> Row[Any] | None:
    """EXECUTING → COMPLETED with the result; with ``event``, the ``completed`` event in the same statement.
    Counted as a run of the call (``attempts``)."""
    def make() -> Any:
        extra = {"context_key": P_CONTEXT_KEY} if context_key else {}
        extra.update(_attempt_added(attempt))
        return _cas(
            P_ID, from_statuses=(EXECUTING,), to_status=COMPLETED, reason="Completed",
            result=P_RESULT, voice_response=P_VOICE, completed_at=func.now(), progress=1.0, outcome=DONE, **extra,
            current_step=COMPLETED, attempts=ToolCall.attempts + 1,
            executed_at=func.coalesce(ToolCall.executed_at, func.now()),
            execution_time_ms=_elapsed_ms_since(func.coalesce(ToolCall.resumed_at, ToolCall.executed_at, ToolCall.confirmed_at)),
        )

    params = {"p_id": tool_call_id, "p_result": result, "p_voice": voice_response, "p_context_key": context_key,
              "p_attempt": attempt}
    return _transition_row(s, ("complete", bool(context_key), attempt is not None), params, make, event,
                           columns=LINK_COLUMNS)


def fail(s: Session, tool_call_id: str, error_message: str, voice_response: str,
         from_statuses: Iterable[str] = (EXECUTING,), uncommitted_only: bool = False,
         at_step: str | None = None, outcome: str = NOT_DONE,
         quiet_s: int | None = None, unrecorded_step: str | None = None,
         chain: str | None = None, step: str | None = None,
         attempt: dict[str, Any] | None = None) -> ToolCall | None:
    """→ FAILED; ``uncommitted_only``: only if the point of no return was not passed;
    ``at_step``: only if the call is still at that step (a side effect's, whose gate recorded it);
    ``unrecorded_step``: only if that step is not recorded yet (a step without side effect, whose
    gate recorded nothing), and, given ``chain``, only while that chain is the call's; ``quiet_s``: only if it is still quiet
    for that long (no link passed its gate since: the stuck-call sweep's judgement, checked
    again by the statement); ``outcome``: whether its action happened (``not_done``,
    ``unconfirmed``, or ``done`` when a step after it failed); ``step``: the step it failed at, recorded
    as its ``current_step`` (a step without side effect records nothing at its gate); ``attempt``: the
    failed run's entry (a link's), added to ``link_attempts``."""
    where = [ToolCall.committed_at.is_(None)] if uncommitted_only else []
    if at_step is not None:
        where.append(ToolCall.current_step == at_step)
    if unrecorded_step is not None:
        where.append(~ToolCall.step_outputs.has_key(unrecorded_step))
    if chain is not None:
        where.append(ToolCall.workflow_id == chain)
    if quiet_s is not None:
        where.append(quiet_for(quiet_s))
    values = {"current_step": step} if step is not None else {}
    values.update(_attempt_added(attempt, built_once=False))
    return _transition(
        s, tool_call_id, from_statuses=from_statuses, to_status=FAILED,
        history=[_entry(FAILED, error_message[:200], **(STUCK_SWEEP if quiet_s is not None else {}))],  # the sweep's
        extra_where=where, outcome=outcome, **values,
        error_message=error_message, voice_response=voice_response, completed_at=func.now(),
        execution_time_ms=_elapsed_ms_since(func.coalesce(ToolCall.resumed_at, ToolCall.executed_at, ToolCall.confirmed_at)),
    )


def mark_run_again(s: Session, tool_call_id: str, new_id: str, acted: Acted, caller: str | None = None) -> ToolCall | None:
    """Note on a FAILED call whose effect was not done that it is run again as ``new_id`` (its history's
    last entry, ``run_again_as``), once: None when it was already run again, did not fail, its effect
    was done (``outcome`` done), or it is not ``caller``'s (when given). No status change."""
    return _transition(
        s, tool_call_id, from_statuses=(FAILED,), to_status=None,
        history=[_entry(FAILED, f"Run again as {new_id}", run_again_as=new_id, **acted)],
        extra_where=[ToolCall.outcome != DONE, ~func.jsonb_path_exists(ToolCall.status_history, "$[*].run_again_as"),
                     *_owned_by(caller)],
    )


def note_redelivered(s: Session, tool_call_id: str, events: list[tuple[int, str, str]], acted: Acted | None) -> None:
    """Add to the call's history that its callback ``events`` (``(seq, event, event_id)``) were sent
    again, by whom and through which face (``acted``): an entry of the call's status as it is (read by
    the statement itself: no status change), its ``redelivered`` the events' ids."""
    if not events:
        return
    named = ", ".join(f"{seq} ({event})" for seq, event, _ in sorted(events))
    reason = f"Callback{'s' if len(events) > 1 else ''} redelivered: event{'s' if len(events) > 1 else ''} {named}"
    note = bindparam(None, {"reason": reason, **(acted or {}), "redelivered": [e for _, _, e in sorted(events)]},
                     type_=JSONB)
    entry = func.jsonb_build_object("status", ToolCall.status).op("||")(note).op("||")(
        func.jsonb_build_object("at", _NOW_ISO))
    s.execute(update(CALLS).where(CALLS.c.tool_call_id == tool_call_id)
              .values(status_history=CALLS.c.status_history.op("||")(func.jsonb_build_array(entry))))


# -- sweeps (beat) --------------------------------------------------------------

def expire(s: Session, tool_call_id: str, *, pending_ttl_s: int, prepared_ttl_s: int) -> ToolCall | None:
    """PENDING/PREPARED → EXPIRED if still stale (``queries.stale``'s condition, checked by the statement)."""
    return _transition(
        s, tool_call_id, from_statuses=(PENDING, PREPARED), to_status=EXPIRED,
        history=[_entry(EXPIRED, EXPIRED_REASON, **EXPIRY_SWEEP)],
        extra_where=[stale_where(pending_ttl_s, prepared_ttl_s)],
        completed_at=func.now(), error_message=EXPIRED_REASON, outcome=NOT_DONE,
    )


REDRIVEN_REASON = "Run again: its worker stopped after the point of no return"


def redrive(s: Session, tool_call_id: str, older_than_s: int, max_redrives: int,
            workflow_id: str | None = None) -> ToolCall | None:
    """Claim a stuck call past its point of no return for one more run of its chain.

    Its side effect carries an idempotency key, so running the rest again finishes
    it with the effect done once; failing it would tell the caller "not done" about
    something that may have been done. ``resumed_at`` becomes the new sign of life,
    so the sweep claims it again only after another quiet period. At most
    ``max_redrives`` times: a chain that keeps dying is given up (:func:`give_up`).
    ``workflow_id``: the id the chain will be sent again with, recorded now: the chain that
    was running, if it still is, stops at its next gate (its side effect is claimed: a new
    attempt waits for a live claim).
    """
    values = {"workflow_id": workflow_id} if workflow_id else {}
    return _transition(
        s, tool_call_id, from_statuses=(EXECUTING,), to_status=None,
        history=[_entry(EXECUTING, REDRIVEN_REASON, **STUCK_SWEEP)],
        extra_where=[ToolCall.committed_at.is_not(None), quiet_for(older_than_s),
                     ToolCall.redrives < max_redrives],
        resumed_at=func.now(), redrives=ToolCall.redrives + 1, **values,
    )


def give_up(s: Session, tool_call_id: str, older_than_s: int, max_redrives: int,
            error_message: str, voice_response: str) -> ToolCall | None:
    """→ FAILED a committed call still stuck after ``max_redrives`` runs.

    Its side effect may have happened: the caller is told so (never "not done"),
    and ``committed_at`` stays set for the audit.
    """
    return _transition(
        s, tool_call_id, from_statuses=(EXECUTING,), to_status=FAILED,
        history=[_entry(FAILED, error_message[:200], **STUCK_SWEEP)],
        extra_where=[ToolCall.committed_at.is_not(None), quiet_for(older_than_s),
                     ToolCall.redrives >= max_redrives],
        outcome=UNCONFIRMED, error_message=error_message, voice_response=voice_response, completed_at=func.now(),
        execution_time_ms=_elapsed_ms_since(func.coalesce(ToolCall.resumed_at, ToolCall.executed_at, ToolCall.confirmed_at)),
    )
