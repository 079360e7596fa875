"""The REST API a relay calls (CONTRACT section 5), paths as the seed names them.

Every view is thin: load the request with a schema, call one lifecycle or chains
operation, dump the answer with a schema. Errors are raised and answered in
``app.errors``.
"""
from __future__ import annotations

from typing import Any

from flask import Blueprint, g, request
from marshmallow import ValidationError

from app import inputs, schemas
from app.errors import ApiError, validation_error
from app.openapi import doc
from app.toolspec import definitions
from app.wait import until_settled
from models import db, lifecycle
from models.calls import PENDING, ToolCall
from tasks import callbacks, chains, tools

bp = Blueprint("api", __name__)

MODIFY_ATTEMPTS = 5


# -- shared pieces ------------------------------------------------------------------

def _tool_call_id(value: str) -> str:
    return inputs.load(schemas.ToolCallPath, {"tool_call_id": value})["tool_call_id"]


def _tool(call: ToolCall) -> tools.Tool:
    return tools.TOOLS[call.function_name]


def _check_reference_context(s, session_id: str, parameters: dict[str, Any]) -> None:
    """``reference_context`` must name an unexpired session_context row of the session."""
    key = parameters.get("reference_context")
    if key and lifecycle.get_context(s, session_id, key) is None:
        raise validation_error({"parameters": {"reference_context": [
            f"No context {key!r} for session {session_id} (missing or expired)."]}})


def _pending_body(data: dict[str, Any]) -> dict[str, Any]:
    """A pending/execute body with the Idempotency-Key header folded in, loaded."""
    header = request.headers.get("Idempotency-Key")
    if header is not None:
        if "idempotency_key" in data and data["idempotency_key"] != header:
            raise validation_error({"idempotency_key": ["Differs from the Idempotency-Key header."]})
        data = {**data, "idempotency_key": header}
    return inputs.load(schemas.PendingRequest, data)


def _record(loaded: dict[str, Any], reason: str) -> tuple[ToolCall, bool]:
    tool: tools.Tool = loaded["tool"]
    with db.session() as s:
        _check_reference_context(s, loaded["session_id"], loaded["parameters"])
        return lifecycle.create(
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
            caller=g.get("caller"),
            reason=reason,
        )


def _wait_seconds() -> float | None:
    return inputs.load(schemas.WaitQuery, inputs.query()).get("wait")


def _next_message(call: ToolCall) -> str:
    """What happens next once a call starts (or resumes after its checkpoint)."""
    tool = _tool(call)
    if call.current_step:
        following = tool.steps[tool.step_index(call.current_step) + 1:]
        if following and following[0].message:
            return tool.say(following[0].message, call.parameters)
    return tool.say(tool.start_message, call.parameters)


def _started(call: ToolCall, wait: float | None):
    """The answer to confirm / execute / resume proceed, waiting if asked to."""
    message = _next_message(call)  # what the operation just started, whatever the wait sees
    if wait:
        waited, settled = until_settled(call.tool_call_id, wait)
        if settled:
            return schemas.CallRecord().dump(waited), 200
        call = waited
    answer = {"tool_call_id": call.tool_call_id, "status": call.status, "function_name": call.function_name,
              "workflow_id": call.workflow_id, "message": message}
    return schemas.StartAnswer().dump(answer), 202


def _cancelled(call: ToolCall):
    return schemas.CancelAnswer().dump(call), 200


def _execute(data: dict[str, Any], wait: float | None):
    """Record a call the relay already confirmed, then start it (an idempotent replay starts nothing new)."""
    loaded = _pending_body(data)
    call, created = _record(loaded, reason="Recorded (confirmed by the relay)")
    if not created and call.status != PENDING:  # a replay of a call already started: its record
        if wait:
            call, _ = until_settled(call.tool_call_id, wait)
        return schemas.CallRecord().dump(call), 200
    call = chains.confirm(call.tool_call_id, reason="Confirmed by the relay")
    return _started(call, wait)


# -- the call's life --------------------------------------------------------------------

@bp.post("/voice-tools/pending")
@doc("Record a tool call as PENDING", body=schemas.PendingRequest,
     responses={201: schemas.PendingAnswer, 200: schemas.PendingAnswer})
def pending():
    loaded = _pending_body(inputs.body())
    call, created = _record(loaded, reason="Recorded")
    tool = _tool(call)
    message = tool.say(tool.confirmation_message, call.parameters)
    answer = {"tool_call_id": call.tool_call_id, "status": call.status, "function_name": call.function_name,
              "parameters": call.parameters, "message": message, "confirmation_message": message,
              "actions_available": callbacks.actions_available(call.status)}
    return schemas.PendingAnswer().dump(answer), 201 if created else 200


def merge(parameters: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch, one level: a null removes the field."""
    merged = {**parameters, **patch}
    return {key: value for key, value in merged.items() if value is not None}


def changes_between(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"field": key, "old": old.get(key), "new": new.get(key)}
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


@bp.patch("/voice-tools/modify/<tool_call_id>")
@doc("Change the parameters of a PENDING call", body=schemas.ModifyRequest, responses={200: schemas.ModifyAnswer})
def modify(tool_call_id: str):
    tool_call_id = _tool_call_id(tool_call_id)
    patch = inputs.load(schemas.ModifyRequest, inputs.body())["parameters"]
    for attempt in range(MODIFY_ATTEMPTS):
        with db.session() as s:
            call = lifecycle.get(s, tool_call_id)
            if call.status != PENDING:
                raise ApiError(409, "invalid_status", f"Cannot modify a call that is {call.status}.",
                               {"status": call.status, "tool_call_id": tool_call_id})
            tool = _tool(call)
            old = dict(call.parameters)
            try:
                new = tool.schema().load(merge(old, patch))
            except ValidationError as exc:
                raise validation_error({"parameters": exc.messages}) from exc
            if "reference_context" in patch:
                _check_reference_context(s, call.session_id, new)
            changes = changes_between(old, new)
            if changes:
                try:
                    call = lifecycle.modify(s, tool_call_id, old_parameters=old, new_parameters=new, changes=changes)
                except lifecycle.Refused as exc:
                    if exc.code == "stale" and attempt < MODIFY_ATTEMPTS - 1:
                        continue
                    raise
        answer = {"tool_call_id": call.tool_call_id, "status": call.status, "updated_parameters": new,
                  "changes": changes, "message": tool.say(tool.modified_message, new)}
        return schemas.ModifyAnswer().dump(answer), 200
    raise AssertionError("unreachable")  # pragma: no cover


@bp.post("/voice-tools/confirm/<tool_call_id>")
@doc("Confirm a PENDING call: it starts running", body=schemas.ConfirmRequest, query=schemas.WaitQuery,
     responses={202: schemas.StartAnswer, 200: schemas.CallRecord})
def confirm(tool_call_id: str):
    tool_call_id = _tool_call_id(tool_call_id)
    wait = _wait_seconds()
    loaded = inputs.load(schemas.ConfirmRequest, inputs.body())
    call = chains.confirm(tool_call_id, loaded.get("callback_url"), callback_urls=loaded.get("callback_urls"))
    return _started(call, wait)


@bp.post("/voice-tools/execute")
@doc("Record and start at once a call the relay already confirmed", body=schemas.PendingRequest,
     query=schemas.WaitQuery, responses={202: schemas.StartAnswer, 200: schemas.CallRecord})
def execute():
    wait = _wait_seconds()
    return _execute(inputs.body(), wait)


@bp.post("/voice-tools/resume/<tool_call_id>")
@doc("At a checkpoint: proceed or cancel", body=schemas.ResumeRequest, query=schemas.WaitQuery,
     responses={202: schemas.StartAnswer, 200: schemas.CallRecord})
def resume(tool_call_id: str):
    tool_call_id = _tool_call_id(tool_call_id)
    wait = _wait_seconds()
    loaded = inputs.load(schemas.ResumeRequest, inputs.body())
    if loaded["action"] == "cancel":
        return _cancelled(chains.cancel(tool_call_id, loaded.get("reason")))
    return _started(chains.resume(tool_call_id), wait)


@bp.delete("/voice-tools/cancel/<tool_call_id>")
@doc("Cancel a call before its point of no return", body=schemas.CancelRequest, query=schemas.CancelRequest,
     responses={200: schemas.CancelAnswer})
def cancel(tool_call_id: str):
    tool_call_id = _tool_call_id(tool_call_id)
    reason = {**inputs.load(schemas.CancelRequest, inputs.query()),
              **inputs.load(schemas.CancelRequest, inputs.body())}.get("reason")
    return _cancelled(chains.cancel(tool_call_id, reason))


# -- reading ---------------------------------------------------------------------------

@bp.get("/voice-tools/status/<tool_call_id>")
@doc("The whole record of a call", responses={200: schemas.CallRecord})
def status(tool_call_id: str):
    tool_call_id = _tool_call_id(tool_call_id)
    with db.session() as s:
        call = lifecycle.get(s, tool_call_id)
    return schemas.CallRecord().dump(call), 200


@bp.get("/voice-tools/context/<session_id>")
@doc("A session's open calls and its recent finished ones", query=schemas.ContextQuery,
     responses={200: schemas.ContextAnswer})
def context(session_id: str):
    session_id = inputs.load(schemas.SessionPath, {"session_id": session_id})["session_id"]
    limit = inputs.load(schemas.ContextQuery, inputs.query())["limit"]
    with db.session() as s:
        open_calls, recent = lifecycle.session_calls(s, session_id, limit)
    return schemas.ContextAnswer().dump({"session_id": session_id, "pending": open_calls, "recent": recent}), 200


def _stored_context(query: dict[str, Any]):
    loaded = inputs.load(schemas.SessionContextQuery, query)
    with db.session() as s:
        found = lifecycle.get_context(s, loaded["session_id"], loaded["context_key"])
    if found is None:
        raise ApiError(404, "not_found", "Not found or expired", dict(loaded))
    return found


@bp.get("/voice-tools/session-context")
@doc("A stored session context value that has not expired", query=schemas.SessionContextQuery,
     responses={200: schemas.SessionContextAnswer})
def session_context():
    found = _stored_context(inputs.query())
    answer = {"session_id": found.session_id, "context_key": found.context_key,
              "context": found.context_value, "expires_at": found.expires_at}
    return schemas.SessionContextAnswer().dump(answer), 200


@bp.get("/voice-tools/tools")
@doc("Every tool as an OpenAI function definition", query=schemas.ToolsQuery, responses={200: schemas.ToolsAnswer})
def tool_list():
    fmt = inputs.load(schemas.ToolsQuery, inputs.query())["format"]
    return schemas.ToolsAnswer().dump({"format": fmt, "tools": definitions(fmt)}), 200


# -- the seed's final endpoint names (seed 000 "FINAL IMPLEMENTATION") ---------------------

def _flat_alias(tool_name: str):
    tool = tools.TOOLS[tool_name]
    flat = schemas.flat_request_schema(tool)

    def alias():
        wait = _wait_seconds()
        loaded = inputs.load(flat, inputs.body())
        return _execute(schemas.split_flat(loaded, tool), wait)

    alias.__name__ = f"alias_{tool_name}"
    return doc(f"Seed alias: run {tool_name} as /voice-tools/execute does (flat body)", body=flat,
               query=schemas.WaitQuery, responses={202: schemas.StartAnswer, 200: schemas.CallRecord})(alias)


bp.add_url_rule("/execute-gmail", view_func=_flat_alias("send_email"), methods=["POST"])
bp.add_url_rule("/query-vector-db", view_func=_flat_alias("query_vector_db"), methods=["POST"])


@bp.get("/get-session-context")
@doc("Seed alias of /voice-tools/session-context: {context}", query=schemas.SessionContextQuery,
     responses={200: schemas.LegacyContextAnswer})
def legacy_session_context():
    found = _stored_context(inputs.query())
    return schemas.LegacyContextAnswer().dump({"context": found.context_value}), 200
