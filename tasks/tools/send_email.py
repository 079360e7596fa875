"""send_email: write, with a checkpoint before the send.

Backends: the local outbox (default) or Gmail (``settings.load().uses_google("gmail")``),
both idempotent on the tool_call_id through a fixed ``Message-ID``. On Gmail, PREPARING
also makes the Gmail draft and records its id, which SENDING sends (``voice_tools_backends/gmail.py``).

``reference_context`` names a ``session_context`` row of the call's session (e.g.
``last_query_results``, stored by query_vector_db): PREPARING reads it once and the
draft's body carries it, summarised (the query and its top results: title and a
one-line snippet, at most five). The draft is PREPARING's recorded output, so a
redelivered link or the links after the checkpoint never read the context again; the
checkpoint's ``preview`` shows that body. A context gone by the time the call runs
fails the call before the point of no return: nothing is sent.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from marshmallow import Schema, fields, validate

from models import db, session_context, settings
from voice_tools_backends import email, gmail, google
from tasks.tools import PermanentError, Step, StepInput, Tool

MAX_REFERENCED = 5  # results quoted in the body
TITLE_CHARS = 120
SNIPPET_CHARS = 160


class SendEmailParameters(Schema):
    to = fields.Email(required=True, metadata={"description": "Recipient email address"})
    subject = fields.String(required=True, validate=validate.Length(min=1, max=500),
                            metadata={"description": "Subject line"})
    body = fields.String(load_default="", validate=validate.Length(max=50_000),
                         metadata={"description": "Plain-text body"})
    cc = fields.List(fields.Email(), load_default=list, validate=validate.Length(max=20),
                     metadata={"description": "Addresses to copy"})
    reference_context = fields.String(
        validate=validate.Length(min=1, max=100),
        metadata={"description": "A session_context key (e.g. last_query_results) whose content the email "
                                 "carries: the query's top results are added to the body"},
    )


class SendEmailResult(Schema):
    message_id = fields.String(required=True, metadata={
        "description": "Gmail's message id on Gmail; the RFC 5322 Message-ID on the local outbox"})
    thread_id = fields.String(required=True, metadata={"description": "The conversation (thread) id"})
    to = fields.Email(required=True, metadata={"description": "Recipient email address"})


# -- reference_context, summarised for an email ----------------------------------------------

def one_line(text: Any, limit: int) -> str:
    """``text`` on one line, cut at a word boundary to at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 3].rsplit(" ", 1)[0] or flat[: limit - 3]
    return cut.rstrip(" ,;:.") + "..."


def summarise_context(key: str, value: Any) -> str:
    """What a context holds, as plain text for an email body.

    A query's results (``{query, documents: [{title, snippet}, ...]}``, query_vector_db's
    shape) become "Results for '<query>':" and the top results, one per line; any other
    value its ``summary``, or its first fields.
    """
    if not isinstance(value, dict):
        return f"From {key}: {one_line(json.dumps(value, default=str), 500)}"
    query = value.get("query")
    heading = f"Results for '{one_line(query, 200)}':" if query else f"From {key}:"
    documents = [d for d in value.get("documents") or [] if isinstance(d, dict)]
    if documents:
        lines = [heading]
        for n, doc in enumerate(documents[:MAX_REFERENCED], 1):
            title = one_line(doc.get("title") or doc.get("id") or "Untitled", TITLE_CHARS)
            snippet = one_line(doc.get("snippet") or doc.get("content") or "", SNIPPET_CHARS)
            lines.append(f"{n}. {title}" + (f": {snippet}" if snippet else ""))
        if len(documents) > MAX_REFERENCED:
            lines.append(f"({len(documents) - MAX_REFERENCED} more not shown.)")
        return "\n".join(lines)
    if "documents" in value:
        return f"{heading} no matching documents."
    if value.get("summary"):
        return f"{heading} {one_line(value['summary'], 500)}"
    lines = [heading]
    for name, item in [(k, v) for k, v in value.items() if k not in {"tool_call_id", "query"}][:MAX_REFERENCED]:
        shown = item if isinstance(item, str) else json.dumps(item, default=str)
        lines.append(f"- {name}: {one_line(shown, SNIPPET_CHARS)}")
    return "\n".join(lines)


def referenced(session_id: str, key: str, caller: str = "") -> tuple[str, dict[str, Any]]:
    """The context ``key`` of the caller's session, summarised; PermanentError when it has expired."""
    with db.session() as s:
        found = session_context.get_context(s, session_id, key, caller=caller)
        value = found.context_value if found is not None else None
    if found is None:
        raise PermanentError(f"the referenced results ({key}) have expired")
    documents = value.get("documents") if isinstance(value, dict) else None
    used = {"context_key": key, "query": value.get("query") if isinstance(value, dict) else None,
            "document_ids": [d.get("id") for d in (documents or [])[:MAX_REFERENCED] if isinstance(d, dict)]}
    return summarise_context(key, value), used


# -- the steps ------------------------------------------------------------------------------

def prepare(step: StepInput) -> dict[str, Any]:
    p = step.parameters
    body = p.get("body") or ""
    reference = None
    if p.get("reference_context"):
        text, reference = referenced(step.session_id, p["reference_context"], step.caller)
        body = f"{body.rstrip()}\n\n{text}" if body.strip() else text
    draft = {
        "to": p["to"],
        "cc": list(p.get("cc") or []),
        "subject": re.sub(r"[\r\n]+", " ", p["subject"]).strip(),  # one header line
        "body": body,
        "reference_context": p.get("reference_context"),
        "reference": reference,
        "message_id": email.message_id_for(step.tool_call_id),
    }
    if settings.load().uses_google("gmail"):  # the draft SENDING sends, recorded before the checkpoint
        with google.acting_for(step.caller):  # in the caller's own mailbox, where configured
            draft["gmail_draft_id"] = gmail.prepare(draft)
    return draft


def preview(step: StepInput) -> dict[str, Any]:
    draft = step.outputs["PREPARING"]
    return {key: draft[key] for key in ("to", "cc", "subject", "body")}


def send(step: StepInput) -> dict[str, Any]:
    draft = step.outputs["PREPARING"]
    if not settings.load().uses_google("gmail"):
        return email.send(step.tool_call_id, draft, step.caller)
    with google.acting_for(step.caller):  # the caller's own Gmail credentials, where configured
        return gmail.send(step.tool_call_id, draft, earlier_attempt=step.earlier_attempt)


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    return dict(outputs["SENDING"])


TOOL = Tool(
    name="send_email",
    description="Send an email. Record it, let the caller confirm, then send it after a final check.",
    schema=SendEmailParameters,
    action_level="write",
    steps=(
        Step("PREPARING", run=prepare, message="Preparing the email to {to}."),
        Step("READY_TO_SEND", checkpoint=True, preview=preview, message="The email to {to} is ready. Send it?"),
        Step("SENDING", run=send, side_effect=True, message="Sending the email to {to}."),
        Step("COMPLETED", message="Email sent to {to}."),
    ),
    result=result,
    confirmation_message="Ready to send email to {to}. Confirm to proceed.",
    start_message="Preparing the email to {to}.",
    modified_message="Updated to {to}. Confirm?",
    voice_response="Email sent to {to}.",
    failure_response="The email to {to} was not sent: {error}.",
    cancelled_response="Cancelled. The email was not sent.",
    unconfirmed_response="I could not confirm that the email to {to} was sent. Please check your sent mail before trying again.",
    after_effect_failure_response="The email to {to} was sent, but a later step failed: {error}.",
    time_limit=60,
    example={"to": "john@example.com", "subject": "Q3 sales numbers",
             "body": "Hi John, the Q3 numbers for the Northwest region are in. Talk tomorrow."},
    result_schema=SendEmailResult,
)
