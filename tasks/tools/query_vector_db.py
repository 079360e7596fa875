"""query_vector_db: read; searches the document store and keeps the results in the
session's context as ``last_query_results`` for an email to draw on."""
from __future__ import annotations

from typing import Any, Mapping

from marshmallow import Schema, fields, validate

from models import db, lifecycle, settings
from tasks.backends import documents
from tasks.tools import Step, StepInput, Tool

CONTEXT_KEY = "last_query_results"


class StructuredQuery(Schema):
    semantic_query = fields.String(validate=validate.Length(max=1000),
                                   metadata={"description": "What to look for, in words"})
    filters = fields.Dict(keys=fields.String(), metadata={"description": "Metadata that must match"})


class QueryVectorDbParameters(Schema):
    user_query = fields.String(required=True, validate=validate.Length(min=1, max=2000),
                               metadata={"description": "The caller's question"})
    structured_query = fields.Nested(StructuredQuery, metadata={"description": "The query as the agent wrote it"})
    top_k = fields.Integer(load_default=5, validate=validate.Range(min=1, max=50),
                           metadata={"description": "How many documents to return"})


def plan(step: StepInput) -> dict[str, Any]:
    p = step.parameters
    structured = p.get("structured_query") or {}
    return {
        "text": structured.get("semantic_query") or p["user_query"],
        "filters": structured.get("filters") or {},
        "top_k": p.get("top_k") or 5,
    }


def search(step: StepInput) -> dict[str, Any]:
    q = step.outputs["QUERYING"]
    return {"documents": documents.search(q["text"], q["top_k"], q["filters"])}


def summarise(found: list[dict[str, Any]]) -> str:
    if not found:
        return "No matching documents."
    return f"{len(found)} document{'s' if len(found) != 1 else ''} found; best match: {found[0]['title']}."


def store_context(step: StepInput) -> dict[str, Any]:
    found = step.outputs["SEARCHING"]["documents"]
    value = {"query": step.parameters["user_query"], "summary": summarise(found), "documents": found,
             "tool_call_id": step.tool_call_id}
    with db.session() as s:
        expires_at = lifecycle.put_context(s, step.session_id, CONTEXT_KEY, value, settings.load().session_context_ttl_s)
    return {"context_key": CONTEXT_KEY, "expires_at": expires_at.isoformat()}


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    found = outputs["SEARCHING"]["documents"]
    return {"summary": summarise(found), "documents": found, "context_key": CONTEXT_KEY}


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    if not result or not result.get("documents"):
        return f"I found nothing for {parameters.get('user_query', 'that')}."
    return f"{result['summary']} It is available if you want to use it in an email."


TOOL = Tool(
    name="query_vector_db",
    description="Search the company documents for the caller's question; results stay available for an email.",
    schema=QueryVectorDbParameters,
    action_level="read",
    steps=(
        Step("QUERYING", run=plan, message="Looking up {user_query}."),
        Step("SEARCHING", run=search, message="Searching the documents."),
        Step("STORE_CONTEXT", run=store_context, message="Keeping the results for this conversation."),
        Step("COMPLETED", message="Search finished."),
    ),
    result=result,
    confirmation_message="Ready to search for {user_query}. Confirm to proceed.",
    start_message="Searching for {user_query}.",
    modified_message="Updated the search to {user_query}. Confirm?",
    voice_response=voice_response,
    failure_response="The search for {user_query} did not run: {error}.",
    cancelled_response="Cancelled. The search was not run.",
    time_limit=30,
)
