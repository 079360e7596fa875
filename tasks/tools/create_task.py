"""create_task: write, no checkpoint (a to-do is cheap to undo, so confirming the call is the
only gate); adds one task to the caller's task list (local table or Google Tasks)."""
from __future__ import annotations

from datetime import date
from typing import Any, Mapping

from marshmallow import Schema, ValidationError, fields, validate

from voice_tools_backends import task_list
from tasks.tools import PermanentError, Step, StepInput, Tool

PRIORITIES = ("low", "medium", "high")
NOT_BLANK = validate.Regexp(r"\S", error="Must not be blank.")


def _iso_date(value: str) -> None:
    try:
        if len(value) != 10:
            raise ValueError(value)
        date.fromisoformat(value)
    except ValueError:
        raise ValidationError("Not a valid date: give it as YYYY-MM-DD, e.g. 2026-11-27.") from None


class CreateTaskParameters(Schema):
    title = fields.String(required=True, validate=[validate.Length(min=1, max=500), NOT_BLANK],
                          metadata={"description": "What to do, e.g. Call the printer"})
    notes = fields.String(load_default="", validate=validate.Length(max=4000),
                          metadata={"description": "Details to keep with the task (default none)"})
    due = fields.String(validate=_iso_date,
                        metadata={"description": "The day it is due, as YYYY-MM-DD (optional)"})
    priority = fields.String(load_default="medium", validate=validate.OneOf(PRIORITIES),
                             metadata={"description": "How urgent it is: low, medium or high (default medium)"})


class CreateTaskResult(Schema):
    task_id = fields.String(required=True, metadata={"description": "The task's id in the task list"})
    title = fields.String(required=True, metadata={"description": "The task's title"})
    due = fields.String(required=True, allow_none=True, validate=_iso_date,
                        metadata={"description": "YYYY-MM-DD, or null"})
    priority = fields.String(required=True, validate=validate.OneOf(PRIORITIES),
                             metadata={"description": "low, medium or high"})
    web_link = fields.String(required=True, allow_none=True,
                             metadata={"description": "Where to open it in Google Tasks (null on the local backend)"})


def spoken_date(iso: str) -> str:
    """``2026-11-27`` → ``Friday November 27`` (the year added when it is not this year's)."""
    day = date.fromisoformat(iso)
    said = f"{day:%A} {day:%B} {day.day}"
    return said if day.year == date.today().year else f"{said}, {day.year}"


def _due(parameters: Mapping[str, Any]) -> str:
    return f", due {spoken_date(parameters['due'])}" if parameters.get("due") else ""


def prepare(step: StepInput) -> dict[str, Any]:
    p = step.parameters
    title = " ".join(str(p["title"]).split())
    if not title:
        raise PermanentError("the task had no title")
    return {"title": title, "notes": p.get("notes") or "", "due": p.get("due") or None,
            "priority": p.get("priority") or "medium"}


def create(step: StepInput) -> dict[str, Any]:
    return task_list.create(step.tool_call_id, step.outputs["PREPARING"], step.caller,
                            earlier_attempt=step.earlier_attempt)


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    created = outputs["CREATING"]
    return {key: created.get(key) for key in ("task_id", "title", "due", "priority", "web_link")}


def confirmation_message(parameters: Mapping[str, Any], **_: Any) -> str:
    return f"Ready to add '{parameters.get('title', '')}' to your tasks{_due(parameters)}. Confirm to proceed."


def modified_message(parameters: Mapping[str, Any], **_: Any) -> str:
    return f"Updated the task to '{parameters.get('title', '')}'{_due(parameters)}. Confirm?"


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    title = (result or {}).get("title") or parameters.get("title", "")
    return f"Added '{title}' to your tasks{_due(parameters)}."


TOOL = Tool(
    name="create_task",
    description="Add a to-do to the caller's task list, with optional notes, due date and priority.",
    schema=CreateTaskParameters,
    action_level="write",
    steps=(
        Step("PREPARING", run=prepare, message="Preparing the task '{title}'."),
        Step("CREATING", run=create, side_effect=True, message="Adding '{title}' to your tasks."),
        Step("COMPLETED", message="Task added."),
    ),
    result=result,
    confirmation_message=confirmation_message,
    start_message="Adding '{title}' to your tasks.",
    modified_message=modified_message,
    voice_response=voice_response,
    failure_response="The task '{title}' was not created: {error}.",
    cancelled_response="Cancelled. The task was not created.",
    unconfirmed_response="I could not confirm that the task '{title}' was created. "
                         "Please check your task list before trying again.",
    after_effect_failure_response="The task '{title}' was created, but a later step failed: {error}.",
    time_limit=30,
    example={"title": "Call the printer", "notes": "Ask about the brochure proofs.", "due": "2026-11-27",
             "priority": "high"},
    result_schema=CreateTaskResult,
)
