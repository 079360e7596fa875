"""The REST API a relay calls (docs/relay-guide.md), and the legacy aliases of the n8n workflows.

Every view is one line: it hands the request's path arguments, query and body to the
operation of the same name in ``tasks.calls.operations`` (shared with the MCP face,
``app.mcp_server``) and answers what it returns; a ``?wait`` is handed to the stream loop
(``app/wait_answer.py``), which answers it. Errors are raised there and
answered by the JSON error handlers of ``app.errors``.
"""
from __future__ import annotations

from flask import Blueprint, g, request

from app import inputs, wait_answer
from app.openapi import doc
from tasks import tools
from tasks.calls import operations, schemas
from tasks.calls.callers import Caller

bp = Blueprint("api", __name__)


def _caller() -> Caller | None:
    """Who asks (set by ``app.auth``): every operation is scoped to it."""
    return g.get("who")


def _idempotency_header() -> str | None:
    return request.headers.get("Idempotency-Key")


# -- the call's life --------------------------------------------------------------------

@bp.post("/voice-tools/pending")
@doc("Record a tool call as PENDING", tag="calls", body=schemas.PendingRequest,
     responses={201: schemas.PendingAnswer, 200: schemas.PendingAnswer})
def pending():
    return operations.pending(inputs.body(), _caller(), _idempotency_header())


@bp.patch("/voice-tools/modify/<tool_call_id>")
@doc("Change the parameters of a PENDING call", tag="calls", body=schemas.ModifyRequest,
     responses={200: schemas.ModifyAnswer})
def modify(tool_call_id: str):
    return operations.modify(tool_call_id, inputs.body(), _caller())


@bp.post("/voice-tools/confirm/<tool_call_id>")
@doc("Confirm a PENDING call: it starts running", tag="calls", body=schemas.ConfirmRequest, query=schemas.WaitQuery,
     responses={202: schemas.StartAnswer, 200: schemas.CallRecord})
def confirm(tool_call_id: str):
    return operations.confirm(tool_call_id, inputs.body(), inputs.query(), _caller(), wait_answer.hand_over())


@bp.post("/voice-tools/execute")
@doc("Record and start at once a call the relay already confirmed", tag="calls", body=schemas.PendingRequest,
     query=schemas.WaitQuery, responses={202: schemas.StartAnswer, 200: schemas.CallRecord})
def execute():
    return operations.execute(inputs.body(), inputs.query(), _caller(), _idempotency_header(),
                              wait_answer.hand_over())


@bp.post("/voice-tools/resume/<tool_call_id>")
@doc("At a checkpoint: proceed or cancel", tag="calls", body=schemas.ResumeRequest, query=schemas.WaitQuery,
     responses={202: schemas.StartAnswer, 200: schemas.CallRecord})
def resume(tool_call_id: str):
    return operations.resume(tool_call_id, inputs.body(), inputs.query(), _caller(), wait_answer.hand_over())


@bp.delete("/voice-tools/cancel/<tool_call_id>")
@doc("Cancel a call before its point of no return", tag="calls", body=schemas.CancelRequest,
     query=schemas.CancelRequest,
     responses={200: schemas.CancelAnswer})
def cancel(tool_call_id: str):
    return operations.cancel(tool_call_id, inputs.body(), inputs.query(), _caller())


# -- reading ---------------------------------------------------------------------------

@bp.get("/voice-tools/status/<tool_call_id>")
@doc("The whole record of a call", tag="calls", responses={200: schemas.CallRecord})
def status(tool_call_id: str):
    return operations.status(tool_call_id, _caller())


@bp.get("/voice-tools/context/<session_id>")
@doc("A session's open calls and its recent finished ones", tag="calls", query=schemas.ContextQuery,
     responses={200: schemas.ContextAnswer})
def context(session_id: str):
    return operations.context(session_id, inputs.query(), _caller())


@bp.get("/voice-tools/session-context")
@doc("A stored session context value that has not expired", tag="calls", query=schemas.SessionContextQuery,
     responses={200: schemas.SessionContextAnswer})
def session_context():
    return operations.session_context(inputs.query(), _caller())


@bp.get("/voice-tools/tools")
@doc("Every tool as an OpenAI function definition", tag="tools", query=schemas.ToolsQuery,
     responses={200: schemas.ToolsAnswer})
def tool_list():
    return operations.tool_list(inputs.query())


# -- the legacy aliases: the n8n workflows' endpoint names -----------------------------------

def _flat_alias(tool_name: str):
    tool = tools.get(tool_name)
    flat = schemas.flat_request_schema(tool)

    def alias():
        return operations.flat_alias(tool, flat, inputs.body(), inputs.query(), _caller(), _idempotency_header(),
                                    wait_answer.hand_over())

    alias.__name__ = f"alias_{tool_name}"
    return doc(f"Legacy alias: run {tool_name} as /voice-tools/execute does (flat body)", tag="calls",
               instead="/voice-tools/execute", body=flat,
               query=schemas.WaitQuery, responses={202: schemas.StartAnswer, 200: schemas.CallRecord})(alias)


bp.add_url_rule("/execute-gmail", view_func=_flat_alias("send_email"), methods=["POST"])
bp.add_url_rule("/query-vector-db", view_func=_flat_alias("query_vector_db"), methods=["POST"])


@bp.get("/get-session-context")
@doc("Legacy alias of /voice-tools/session-context: {context}", tag="calls", instead="/voice-tools/session-context",
     query=schemas.SessionContextQuery,
     responses={200: schemas.LegacyContextAnswer})
def legacy_session_context():
    return operations.legacy_session_context(inputs.query(), _caller())
