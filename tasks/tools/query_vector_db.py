"""query_vector_db: read; searches the document store (embeddings + pgvector) and keeps the
results in the session's context as ``last_query_results`` for an email to draw on."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from marshmallow import Schema, fields, validate

from models import db, session_context, settings
from voice_tools_backends import documents, embeddings
from tasks.tools import PermanentError, Step, StepInput, Tool
from tasks.tools._speech import saying_back, topic

CONTEXT_KEY = "last_query_results"


class StructuredQuery(Schema):
    semantic_query = fields.String(validate=validate.Length(max=1000),
                                   metadata={"description": "What to look for, in words"})
    filters = fields.Dict(keys=fields.String(), metadata={
        "description": "Metadata that must match exactly, e.g. {\"region\": \"northwest\"}"})
    top_k = fields.Integer(validate=validate.Range(min=1, max=50),
                           metadata={"description": "How many documents to return (overrides the top-level top_k)"})


class QueryVectorDbParameters(Schema):
    user_query = fields.String(required=True, validate=validate.Length(min=1, max=2000),
                               metadata={"description": "The caller's question"})
    structured_query = fields.Nested(StructuredQuery, metadata={"description": "The query as the agent wrote it"})
    top_k = fields.Integer(load_default=5, validate=validate.Range(min=1, max=50),
                           metadata={"description": "How many documents to return"})


class FoundDocument(Schema):
    id = fields.String(required=True, metadata={"description": "The chunk's id: <document>#<n>"})
    title = fields.String(required=True)
    snippet = fields.String(required=True)
    score = fields.Float(required=True, metadata={"description": "Cosine similarity, -1..1"})
    metadata = fields.Dict(required=True)


class QueryVectorDbResult(Schema):
    summary = fields.String(required=True)
    documents = fields.List(fields.Nested(FoundDocument), required=True)
    context_key = fields.String(required=True)


@contextmanager
def store_errors() -> Iterator[None]:
    """The store's refusals (no pgvector, another model, a refused API key) end the call FAILED."""
    try:
        yield
    except documents.PERMANENT_ERRORS as exc:
        raise PermanentError(str(exc)) from exc


def embed_query(text: str) -> dict[str, Any]:
    """Embed the question once (a retried SEARCHING does not embed again)."""
    with store_errors():
        vector = embeddings.embed_query(text)
    model, _ = embeddings.active_model()
    return {"model": model, "vector": [round(float(x), 7) for x in vector]}


def find(text: str, query: Mapping[str, Any], top_k: int, filters: Mapping[str, Any] | None,
         caller: str = "") -> dict[str, Any]:
    """The caller's own and the shared documents most relevant to the question (its vector and the words
    that were embedded), and a sentence about them."""
    with store_errors():
        found = documents.search_vector(query["vector"], query["model"], top_k, dict(filters or {}), caller=caller,
                                        text=query.get("text") or text)
    return {"documents": found, "summary": documents.summarise(text, found)}


def plan(step: StepInput) -> dict[str, Any]:
    p = step.parameters
    structured = p.get("structured_query") or {}
    text = structured.get("semantic_query") or p["user_query"]
    return {
        "text": text,
        "filters": structured.get("filters") or {},
        "top_k": structured.get("top_k") or p.get("top_k") or 5,
        **embed_query(text),
    }


def search(step: StepInput) -> dict[str, Any]:
    q = step.outputs["QUERYING"]
    return find(step.parameters["user_query"], q, q["top_k"], q["filters"], step.caller)


def store_context(step: StepInput) -> dict[str, Any]:
    searched = step.outputs["SEARCHING"]
    value = {"query": step.parameters["user_query"], "summary": searched["summary"],
             "documents": searched["documents"], "tool_call_id": step.tool_call_id}
    with db.session() as s:
        expires_at = session_context.put_context(s, step.session_id, CONTEXT_KEY, value, settings.load().session_context_ttl_s,
                                           caller=step.caller)
    return {"context_key": CONTEXT_KEY, "expires_at": expires_at.isoformat()}


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    searched = outputs["SEARCHING"]
    found = searched["documents"]
    return {"summary": searched.get("summary") or documents.plain_summary(found), "documents": found,
            "context_key": CONTEXT_KEY}


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    if not result or not result.get("documents"):
        about = topic(parameters.get("user_query", ""))
        return f"I couldn't find any documents about {about}." if about else "I couldn't find any documents about that."
    found = result["documents"]
    said = result["summary"]
    if said == documents.plain_summary(found):  # no chat model: say it as a sentence
        said = (f"I found {len(found)} document{'s' if len(found) != 1 else ''}; "
                f"the best match is {found[0]['title']}.")
    return f"{said} It is available if you want to use it in an email."


TOOL = Tool(
    name="query_vector_db",
    description="Search the company documents for the caller's question; results stay available for an email.",
    schema=QueryVectorDbParameters,
    action_level="read",
    steps=(
        Step("QUERYING", run=plan, message=saying_back("Looking up {user_query}.", "user_query")),
        Step("SEARCHING", run=search, message="Searching the documents."),
        # storing the results is the call's effect: once it is done the call can no longer be
        # cancelled, so it is the point of no return (an upsert: idempotent; docs/promises.md,
        # 'The point of no return')
        Step("STORE_CONTEXT", run=store_context, side_effect=True, message="Keeping the results for this conversation."),
        Step("COMPLETED", message="Search finished."),
    ),
    result=result,
    confirmation_message=saying_back("Ready to search for {user_query}. Confirm to proceed.", "user_query"),
    start_message=saying_back("Searching for {user_query}.", "user_query"),
    modified_message=saying_back("Updated the search to {user_query}. Confirm?", "user_query"),
    voice_response=voice_response,
    failure_response=saying_back("The search for {user_query} did not run: {error}.", "user_query"),
    cancelled_response="Cancelled. The search was not run.",
    unconfirmed_response=saying_back(
        "I could not confirm that the results for {user_query} were kept for this conversation.", "user_query"),
    after_effect_failure_response=saying_back(
        "The results for {user_query} were kept, but a later step failed: {error}.", "user_query"),
    time_limit=30,
    example={"user_query": "What were our Q3 sales in the Northwest region?",
             "structured_query": {"semantic_query": "Q3 sales Northwest region", "filters": {"quarter": "Q3"}},
             "top_k": 3},
    result_schema=QueryVectorDbResult,
)
