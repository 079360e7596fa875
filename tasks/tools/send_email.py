"""send_email: write, with a checkpoint before the send (seed 000 "Send Gmail")."""
from __future__ import annotations

from typing import Any, Mapping

from marshmallow import Schema, fields, validate

from tasks.backends import email
from tasks.tools import Step, StepInput, Tool


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
        metadata={"description": "A session_context key (e.g. last_query_results) the email draws on"},
    )


def prepare(step: StepInput) -> dict[str, Any]:
    p = step.parameters
    return {
        "to": p["to"],
        "cc": list(p.get("cc") or []),
        "subject": p["subject"],
        "body": p.get("body") or "",
        "reference_context": p.get("reference_context"),
        "message_id": email.message_id_for(step.tool_call_id),
    }


def preview(step: StepInput) -> dict[str, Any]:
    draft = step.outputs["PREPARING"]
    return {key: draft[key] for key in ("to", "cc", "subject", "body")}


def send(step: StepInput) -> dict[str, Any]:
    return email.send(step.tool_call_id, step.outputs["PREPARING"])


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
)
