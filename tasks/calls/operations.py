"""The operations on a call, as every door asks them: the REST views (``app.api``), the MCP
tools (``app.mcp_server``) and the operator CLI's cancel (``voice_tools.celery_commands``).

Each takes the operation's inputs as plain data (path arguments, the query and the body,
exactly as received, not yet validated), loads them with the request schemas of
``tasks.calls.schemas``, runs one action of ``tasks.calls.actions`` (or one read) and
returns ``(answer, http_status)`` with the answer dumped by the response schema, from what
the action returned. Errors are raised as :class:`tasks.calls.errors.ApiError`, marshmallow
``ValidationError`` or a lifecycle/chains exception, and every face answers them as
``tasks.calls.errors.api_error`` maps them.

Callers are fenced from each other: every operation takes the
:class:`tasks.calls.callers.Caller` asking (an admin's is unscoped, as the operator CLI's is) and
sees only that caller's calls, session context and events, unless it is an admin.
Another caller's call is :class:`models.queries.NotFound`, the same 404 as an unknown id,
and nothing of it changes: each action hands the caller to its transition, whose own
statement checks it. Each action's entry in the call's ``status_history`` says who asked
(``by``, the caller's name) and through which face (``via``, the caller's ``via``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from marshmallow import ValidationError

from models import db, lifecycle, logs, queries
from models.calls import PENDING, ToolCall
from models.listen import until_settled
from models.session_context import get_context
from tasks import tools
from tasks.calls import actions, schemas
from tasks.calls.callers import Caller, acted, cancel_reason, name_of, scope_of
from tasks.calls.errors import ApiError, validation_error
from tasks.calls.toolspec import definitions

Answer = tuple[dict[str, Any], int]

MODIFY_ATTEMPTS = 5


# -- shared pieces ------------------------------------------------------------------

def _tool_call_id(value: Any) -> str:
    return schemas.load(schemas.ToolCallPath, {"tool_call_id": value})["tool_call_id"]


def _session_id(value: Any) -> str:
    return schemas.load(schemas.SessionPath, {"session_id": value})["session_id"]


def _logged(call: ToolCall) -> ToolCall:
    """The call, its ids now on the rest of the request's log lines (see ``logs``)."""
    logs.add(tool_call_id=call.tool_call_id, session_id=call.session_id)
    return call


def _check_reference_context(s, session_id: str, parameters: dict[str, Any], owner: str | None) -> None:
    """``reference_context`` must name an unexpired session_context row of the session, of the
    call's own caller (``owner``), the one the email's link will read."""
    key = parameters.get("reference_context")
    if key and get_context(s, session_id, key, caller=owner or "") is None:
        raise validation_error({"parameters": {"reference_context": [
            f"No context {key!r} for session {session_id} (missing or expired)."]}})


def _pending_body(data: dict[str, Any], idempotency_header: str | None) -> dict[str, Any]:
    """A pending/execute body with the Idempotency-Key header (if any) folded in, loaded."""
    if idempotency_header is not None:
        if "idempotency_key" in data and data["idempotency_key"] != idempotency_header:
            raise validation_error({"idempotency_key": ["Differs from the Idempotency-Key header."]})
        data = {**data, "idempotency_key": idempotency_header}
    return schemas.load(schemas.PendingRequest, data)


def _record(loaded: dict[str, Any], caller: Caller | None, reason: str, kind: str) -> tuple[ToolCall, bool]:
    tool: tools.Tool = loaded["tool"]
    with db.statement() as s:  # the INSERT is the whole work: its own transaction, one round trip
        _check_reference_context(s, loaded["session_id"], loaded["parameters"], name_of(caller))
        call, created = lifecycle.create(
            s,
            session_id=loaded["session_id"],
            function_name=tool.name,
            action_level=tool.action_level,
            parameters=loaded["parameters"],
            tool_call_id=loaded.get("tool_call_id"),
            connection_id=loaded.get("connection_id"),
            intent_id=loaded.get("intent_id"),
            callback_url=loaded.get("callback_url"),
            callback_urls=loaded.get("callback_urls"),
            idempotency_key=loaded.get("idempotency_key"),
            caller=name_of(caller),
            reason=reason,
            request_kind=kind,
            acted=acted(caller),
        )
    return _logged(call), created  # the new call's id on the request's log lines (not read back from the answer)


def _wait_seconds(query: dict[str, Any]) -> float | None:
    return schemas.load(schemas.WaitQuery, query).get("wait")


@dataclass(frozen=True)
class Waiting:
    """A ``wait`` an operation asks for: until call ``tool_call_id`` is PREPARED or final, ``seconds`` at
    most. Its answer is the call's record (200) once settled, else ``unsettled`` of the call as it is
    then. A face waits it here (:meth:`block`, holding its thread) or hands it to an event loop
    (``models.listen.until_settled_async``, then :meth:`answer`)."""

    tool_call_id: str
    seconds: float
    unsettled: Callable[[ToolCall], Answer]

    def answer(self, call: ToolCall, settled: bool) -> Answer:
        if settled:
            return schemas.instance(schemas.CallRecord).dump(call), 200
        return self.unsettled(call)

    def block(self) -> Answer:
        return self.answer(*until_settled(self.tool_call_id, self.seconds))


HandOver = Callable[[Waiting], Any]  # a face's way to answer a wait without blocking: what it returns is answered


def _waited(waiting: Waiting, hand_over: HandOver | None) -> Any:
    return waiting.block() if hand_over is None else hand_over(waiting)


def _record_of(call: ToolCall) -> Answer:
    return schemas.instance(schemas.CallRecord).dump(call), 200


def _started(started: actions.Started, wait: float | None, hand_over: HandOver | None = None) -> Any:
    """The answer to confirm / execute / resume proceed, waiting if asked to: what the action
    started (its sentence), whatever the wait sees."""
    call = _logged(started.call)

    def start_answer(call: ToolCall) -> Answer:
        answer = {"tool_call_id": call.tool_call_id, "status": call.status, "function_name": call.function_name,
                  "workflow_id": call.workflow_id, "message": started.message}
        return schemas.instance(schemas.StartAnswer).dump(answer), 202

    if wait:
        return _waited(Waiting(call.tool_call_id, wait, start_answer), hand_over)
    return start_answer(call)


def _cancelled(call: ToolCall) -> Answer:
    return schemas.instance(schemas.CancelAnswer).dump(_logged(call)), 200


def _execute_loaded(data: dict[str, Any], wait: float | None, caller: Caller | None,
                    idempotency_header: str | None, hand_over: HandOver | None = None) -> Any:
    """Record a call the relay already confirmed, then start it (an idempotent replay starts nothing new)."""
    loaded = _pending_body(data, idempotency_header)
    call, created = _record(loaded, caller, reason="Recorded as confirmed (execute)", kind="execute")
    if created or call.status == PENDING:  # new, or left PENDING by a broker outage: start it
        try:
            started = actions.confirm(call.tool_call_id, reason="Confirmed when recorded (execute)", caller=scope_of(caller),
                                      acted=acted(caller))
        except lifecycle.Refused as exc:
            # a concurrent request with this key started it first (or it ended meanwhile):
            # this one is a replay of a call already started
            call = exc.call
        else:
            return _started(started, wait, hand_over)
    if wait:  # a replay of a call already started: its record
        return _waited(Waiting(call.tool_call_id, wait, _record_of), hand_over)
    return _record_of(call)


def merge(parameters: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch, one level: a null removes the field."""
    merged = {**parameters, **patch}
    return {key: value for key, value in merged.items() if value is not None}


def changes_between(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"field": key, "old": old.get(key), "new": new.get(key)}
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


# -- the call's life --------------------------------------------------------------------

def pending(body: dict[str, Any], caller: Caller | None, idempotency_header: str | None = None) -> Answer:
    """POST /voice-tools/pending: record a call as PENDING (201, or 200 for an idempotent replay)."""
    loaded = _pending_body(body, idempotency_header)
    call, created = _record(loaded, caller, reason="Recorded", kind="pending")
    tool = loaded["tool"]  # the replay of a call is of the same tool (or a conflict)
    message = tool.say(tool.confirmation_message, call.parameters)
    answer = {"tool_call_id": call.tool_call_id, "status": call.status, "function_name": call.function_name,
              "parameters": call.parameters, "message": message, "confirmation_message": message,
              "actions_available": schemas.offered(call)}
    return schemas.instance(schemas.PendingAnswer).dump(answer), 201 if created else 200


def modify(tool_call_id: Any, body: dict[str, Any], caller: Caller | None = None) -> Answer:
    """PATCH /voice-tools/modify/{id}: change the parameters of a PENDING call.

    The merge is validated against the call as read (the caller's own: its parameters and
    tool), and the transition applies only to the parameters read, for the same caller.
    """
    tool_call_id = _tool_call_id(tool_call_id)
    patch = schemas.load(schemas.ModifyRequest, body)["parameters"]
    scope = scope_of(caller)
    for attempt in range(MODIFY_ATTEMPTS):
        with db.session() as s:
            call = queries.get(s, tool_call_id, caller=scope)
            if call.status != PENDING:
                raise ApiError(409, "invalid_status", f"Cannot modify a call that is {call.status}.",
                               {"status": call.status, "tool_call_id": tool_call_id})
            tool = actions.tool_of(call)  # a tool this process does not run: 422, as an unknown tool in a body
            old = dict(call.parameters)
            try:
                new = schemas.instance(tool.schema).load(merge(old, patch))
            except ValidationError as exc:
                raise validation_error({"parameters": exc.messages}) from exc
            if "reference_context" in patch:
                _check_reference_context(s, call.session_id, new, call.caller)
            changes = changes_between(old, new)
            if changes:
                try:
                    call = lifecycle.modify(s, tool_call_id, old_parameters=old, new_parameters=new,
                                            changes=changes, caller=scope, acted=acted(caller))
                except lifecycle.Refused as exc:
                    if exc.code == "stale" and attempt < MODIFY_ATTEMPTS - 1:
                        continue
                    raise
        answer = {"tool_call_id": call.tool_call_id, "status": call.status, "updated_parameters": new,
                  "changes": changes, "message": tool.say(tool.modified_message, new)}
        return schemas.instance(schemas.ModifyAnswer).dump(answer), 200
    raise AssertionError("unreachable")  # pragma: no cover


def confirm(tool_call_id: Any, body: dict[str, Any], query: dict[str, Any], caller: Caller | None = None,
            hand_over: HandOver | None = None) -> Any:
    """POST /voice-tools/confirm/{id}[?wait=S]: a PENDING call starts running. A wait is waited here, or
    given to ``hand_over`` (module :class:`Waiting`), whose result is the answer."""
    tool_call_id = _tool_call_id(tool_call_id)
    wait = _wait_seconds(query)
    loaded = schemas.load(schemas.ConfirmRequest, body)
    started = actions.confirm(tool_call_id, loaded.get("callback_url"), callback_urls=loaded.get("callback_urls"),
                              caller=scope_of(caller), acted=acted(caller))
    return _started(started, wait, hand_over)


def execute(body: dict[str, Any], query: dict[str, Any], caller: Caller | None,
            idempotency_header: str | None = None, hand_over: HandOver | None = None) -> Any:
    """POST /voice-tools/execute[?wait=S]: record and start at once a call the relay already confirmed."""
    wait = _wait_seconds(query)
    return _execute_loaded(body, wait, caller, idempotency_header, hand_over)


def resume(tool_call_id: Any, body: dict[str, Any], query: dict[str, Any], caller: Caller | None = None,
           hand_over: HandOver | None = None) -> Any:
    """POST /voice-tools/resume/{id}[?wait=S]: at the checkpoint, proceed or cancel."""
    tool_call_id = _tool_call_id(tool_call_id)
    wait = _wait_seconds(query)
    loaded = schemas.load(schemas.ResumeRequest, body)
    if loaded["action"] == "cancel":
        return _cancelled(actions.cancel(tool_call_id, loaded.get("reason") or cancel_reason(caller),
                                         caller=scope_of(caller), acted=acted(caller)))
    return _started(actions.resume(tool_call_id, caller=scope_of(caller), acted=acted(caller)), wait, hand_over)


def cancel(tool_call_id: Any, body: dict[str, Any], query: dict[str, Any], caller: Caller | None = None) -> Answer:
    """DELETE /voice-tools/cancel/{id}: cancel before the point of no return (reason in the query or body)."""
    tool_call_id = _tool_call_id(tool_call_id)
    reason = {**schemas.load(schemas.CancelRequest, query),
              **schemas.load(schemas.CancelRequest, body)}.get("reason")
    return _cancelled(actions.cancel(tool_call_id, reason or cancel_reason(caller), caller=scope_of(caller),
                                     acted=acted(caller)))


# -- reading ---------------------------------------------------------------------------

def status(tool_call_id: Any, caller: Caller | None = None) -> Answer:
    """GET /voice-tools/status/{id}: the whole record of a call."""
    tool_call_id = _tool_call_id(tool_call_id)
    with db.statement() as s:
        call = _logged(queries.get(s, tool_call_id, caller=scope_of(caller)))
    return schemas.instance(schemas.CallRecord).dump(call), 200


def context(session_id: Any, query: dict[str, Any], caller: Caller | None = None) -> Answer:
    """GET /voice-tools/context/{session_id}: the session's open calls and its recent finished ones
    (the caller's own only)."""
    session_id = _session_id(session_id)
    limit = schemas.load(schemas.ContextQuery, query)["limit"]
    with db.statement() as s:
        open_calls, recent = queries.session_calls(s, session_id, limit, caller=scope_of(caller))
    answer = {"session_id": session_id, "pending": open_calls, "recent": recent}
    return schemas.instance(schemas.ContextAnswer).dump(answer), 200


def _stored_context(query: dict[str, Any], caller: Caller | None):
    loaded = schemas.load(schemas.SessionContextQuery, query)
    with db.session() as s:
        found = get_context(s, loaded["session_id"], loaded["context_key"], caller=scope_of(caller))
    if found is None:
        raise ApiError(404, "not_found", "Not found or expired", dict(loaded))
    return found


def session_context(query: dict[str, Any], caller: Caller | None = None) -> Answer:
    """GET /voice-tools/session-context?session_id&context_key: a stored value that has not expired."""
    found = _stored_context(query, caller)
    answer = {"session_id": found.session_id, "context_key": found.context_key,
              "context": found.context_value, "expires_at": found.expires_at}
    return schemas.instance(schemas.SessionContextAnswer).dump(answer), 200


def legacy_session_context(query: dict[str, Any], caller: Caller | None = None) -> Answer:
    """GET /get-session-context (a legacy alias): ``{context}``."""
    found = _stored_context(query, caller)
    return schemas.instance(schemas.LegacyContextAnswer).dump({"context": found.context_value}), 200


def tool_list(query: dict[str, Any]) -> Answer:
    """GET /voice-tools/tools[?format=]: every tool as an OpenAI function definition."""
    fmt = schemas.load(schemas.ToolsQuery, query)["format"]
    return schemas.instance(schemas.ToolsAnswer).dump({"format": fmt, "tools": definitions(fmt)}), 200


def flat_alias(tool: tools.Tool, flat: type[schemas.Strict], body: dict[str, Any], query: dict[str, Any],
               caller: Caller | None, idempotency_header: str | None = None, hand_over: HandOver | None = None) -> Any:
    """A legacy alias (/execute-gmail, /query-vector-db): /voice-tools/execute with ``tool``'s flat body."""
    wait = _wait_seconds(query)
    loaded = schemas.load(flat, body)
    return _execute_loaded(schemas.split_flat(loaded, tool), wait, caller, idempotency_header, hand_over)
