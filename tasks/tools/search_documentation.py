"""search_documentation: read; answers "how do I ..." questions from the document store
(the same chunks, embeddings and pgvector search as query_vector_db), without keeping
anything in the session's context."""
from __future__ import annotations

from typing import Any, Mapping

from marshmallow import Schema, fields, validate

from voice_tools_backends import documents
from tasks.tools import Step, StepInput, Tool
from tasks.tools._speech import passage, saying_back, topic
from tasks.tools.query_vector_db import FoundDocument, embed_query, find


class SearchDocumentationParameters(Schema):
    query = fields.String(required=True, validate=validate.Length(min=1, max=1000),
                          metadata={"description": "What to look up in the documentation, in the caller's words"})
    top_k = fields.Integer(load_default=5, validate=validate.Range(min=1, max=20),
                           metadata={"description": "How many passages to return"})


class SearchDocumentationResult(Schema):
    summary = fields.String(required=True)
    documents = fields.List(fields.Nested(FoundDocument), required=True)


def understand(step: StepInput) -> dict[str, Any]:
    return {"top_k": step.parameters.get("top_k") or 5, **embed_query(step.parameters["query"])}


def search(step: StepInput) -> dict[str, Any]:
    q = step.outputs["QUERYING"]
    return find(step.parameters["query"], q, q["top_k"], None, step.caller)


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    searched = outputs["SEARCHING"]
    found = searched["documents"]
    return {"summary": searched.get("summary") or documents.plain_summary(found), "documents": found}


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    if not result or not result.get("documents"):
        about = topic(parameters.get("query", ""))
        return (f"I couldn't find anything about {about} in the documentation." if about
                else "I couldn't find an answer to that in the documentation.")
    best = result["documents"][0]
    if result["summary"] != documents.plain_summary(result["documents"]):
        return result["summary"]  # a chat model's spoken answer
    return f"The documentation on {best['title']} says: {passage(best['snippet'])}"


TOOL = Tool(
    name="search_documentation",
    description="Look up how-to and policy questions in the company documentation and read out the best passage.",
    schema=SearchDocumentationParameters,
    action_level="read",
    steps=(
        Step("QUERYING", run=understand, message=saying_back("Looking up {query}.", "query")),
        Step("SEARCHING", run=search, message="Searching the documentation."),
        Step("COMPLETED", message="Search finished."),
    ),
    result=result,
    confirmation_message=saying_back("Ready to look up {query} in the documentation. Confirm to proceed.", "query"),
    start_message=saying_back("Looking up {query} in the documentation.", "query"),
    modified_message=saying_back("Updated the lookup to {query}. Confirm?", "query"),
    voice_response=voice_response,
    failure_response=saying_back("The documentation search for {query} did not run: {error}.", "query"),
    cancelled_response="Cancelled. The documentation search was not run.",
    time_limit=30,
    example={"query": "How do I reset my password?", "top_k": 3},
    result_schema=SearchDocumentationResult,
)
