"""search_contacts: read; finds people in the caller's contacts (local table or Google People API)."""
from __future__ import annotations

from typing import Any, Mapping

from marshmallow import Schema, fields, validate

from voice_tools_backends import contacts
from tasks.tools import PermanentError, Step, StepInput, Tool


NOT_BLANK = validate.Regexp(r"\S", error="Must not be blank.")


class SearchContactsParameters(Schema):
    query = fields.String(required=True, validate=[validate.Length(min=1, max=200), NOT_BLANK],
                          metadata={"description": "A name, email address or organization to look for, e.g. Ann Lee"})
    limit = fields.Integer(load_default=5, validate=validate.Range(min=1, max=25),
                           metadata={"description": "How many contacts to return at most (1 to 25, default 5)"})


class ContactResult(Schema):
    name = fields.String(required=True, metadata={"description": "The contact's display name"})
    email = fields.String(required=True, allow_none=True, metadata={"description": "Primary email address, or null"})
    phone = fields.String(required=True, allow_none=True, metadata={"description": "Primary phone number, or null"})
    organization = fields.String(required=True, allow_none=True,
                                 metadata={"description": "Company or organization, or null"})


class SearchContactsResult(Schema):
    contacts = fields.List(fields.Nested(ContactResult), required=True,
                           metadata={"description": "The matches, best first (at most limit)"})
    count = fields.Integer(required=True, validate=validate.Range(min=0),
                           metadata={"description": "How many contacts are listed"})


def search(step: StepInput) -> dict[str, Any]:
    p = step.parameters
    query = " ".join(str(p["query"]).split())
    if not query:
        raise PermanentError("the search was empty")
    found = contacts.search(query, int(p.get("limit") or 5), step.caller)
    return {"contacts": found}


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    found = list(outputs["SEARCHING"]["contacts"])
    return {"contacts": found, "count": len(found)}


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _possessive(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    found = list((result or {}).get("contacts") or [])
    query = " ".join(str(parameters.get("query") or "that").split())
    if not found:
        return f"I couldn't find a contact named {query}."
    if len(found) == 1:
        person = found[0]
        if person.get("email"):
            return f"{_possessive(person['name'])} email is {person['email']}."
        if person.get("phone"):
            return f"{_possessive(person['name'])} phone number is {person['phone']}."
        return f"I found {person['name']}, with no email address or phone number."
    return f"I found {len(found)} contacts: {_listed([c['name'] for c in found])}."


TOOL = Tool(
    name="search_contacts",
    description="Look up people in the caller's contacts by name, email address or organization; "
                "gives their email, phone number and organization.",
    schema=SearchContactsParameters,
    action_level="read",
    steps=(
        Step("SEARCHING", run=search, message="Looking up {query} in your contacts."),
        Step("COMPLETED", message="Contact search finished."),
    ),
    result=result,
    confirmation_message="Ready to look up {query} in your contacts. Confirm to proceed.",
    start_message="Looking up {query} in your contacts.",
    modified_message="Updated the contact search to {query}. Confirm?",
    voice_response=voice_response,
    failure_response="The contact search for {query} did not run: {error}.",
    cancelled_response="Cancelled. The contact search was not run.",
    time_limit=20,
    example={"query": "Ann", "limit": 5},
    result_schema=SearchContactsResult,
)
