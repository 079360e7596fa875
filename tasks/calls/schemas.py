"""marshmallow schemas for every request body, query and answer of the API.

Requests load through :class:`Strict`: unknown fields are refused, and no string
anywhere in the data (keys included, parameters too, the query string's values as well) may hold
NUL, another control character (C0 but tab, newline and carriage return; DEL; C1, U+0080-U+009F:
Unicode's Cc) or a lone surrogate, so bad text is a 422 and never a database error nor a terminal's
escape sequence. Answers are dumped from the
``ToolCall`` rows with the response schemas, which also feed ``/openapi.json``.
"""
from __future__ import annotations

import re
import functools
from collections.abc import Mapping
from typing import Any

from marshmallow import INCLUDE, RAISE, Schema, ValidationError, fields, post_load, pre_dump, validate

from tasks import tools
from tasks.delivery import url_policy
from models import events
from models.calls import FACES, STATUSES

MAX_TEXT = 1000  # message and voice_response (docs/relay-guide.md, "A call's life")

_FORBIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_FORBIDDEN_MESSAGE = "Must not hold NUL or other control characters."


def forbidden_text(value: Any) -> Any:
    """marshmallow-style messages for every string (or key) in ``value`` with a forbidden character."""
    if isinstance(value, str):
        return [_FORBIDDEN_MESSAGE] if _FORBIDDEN.search(value) else None
    if isinstance(value, dict):
        found: dict[Any, Any] = {}
        for key, item in value.items():
            if isinstance(key, str) and _FORBIDDEN.search(key):
                found[key.encode("unicode_escape", "backslashreplace").decode()] = ["Field names must not hold NUL or other control characters."]
            elif (messages := forbidden_text(item)) is not None:
                found[key] = messages
        return found or None
    if isinstance(value, list):
        found_items = {i: m for i, item in enumerate(value) if (m := forbidden_text(item)) is not None}
        return found_items or None
    return None


@functools.cache
def instance(schema: type[Schema]) -> Schema:
    """One instance per schema class, made once (a schema instance keeps no state between loads or dumps)."""
    return schema()


def load(schema: type[Schema], data: dict[str, Any]) -> dict[str, Any]:
    """Load ``data`` with ``schema``; a ValidationError is the 422 of ``tasks.calls.errors``."""
    return instance(schema).load(data)


def _without_urls(data: Any, urls: tuple[str, ...]) -> Any:
    """``data`` with the URLs of the fields ``urls`` (and of a ``callback_urls`` object) left to their own
    rule (``url_policy``, which refuses every control character, saying where); their keys are kept."""
    if not isinstance(data, dict):
        return data
    kept = {key: "" if key in urls and isinstance(value, str) else value for key, value in data.items()}
    if isinstance(kept.get("callback_urls"), dict):
        kept["callback_urls"] = {key: "" if isinstance(value, str) else value
                                 for key, value in kept["callback_urls"].items()}
    return kept


class Strict(Schema):
    """Base of every request schema: unknown fields and control characters are refused."""

    urls: tuple[str, ...] = ("callback_url",)  # fields whose control characters their URL rule names

    class Meta:
        unknown = RAISE

    def load(self, data: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        messages = forbidden_text(_without_urls(data, self.urls))
        if messages:
            raise ValidationError(messages if isinstance(messages, dict) else {"_schema": messages})
        return super().load(data, **kwargs)


# -- field kinds ----------------------------------------------------------------

IDENTIFIER = validate.Regexp(r"^[A-Za-z0-9_.:\-]+$", error="Use only letters, digits and _ . : -")


def Identifier(**kwargs: Any) -> fields.String:  # noqa: N802  (a field factory)
    """session_id / tool_call_id: at most 100 characters of ``[A-Za-z0-9_.:-]``."""
    return fields.String(validate=[validate.Length(min=1, max=100), IDENTIFIER], **kwargs)


def ShortText(max_length: int = 100, **kwargs: Any) -> fields.String:  # noqa: N802
    return fields.String(validate=validate.Length(min=1, max=max_length), **kwargs)


def _allowed_callback_url(url: str) -> None:
    reason = url_policy.url_error(url)
    if reason is not None:
        raise ValidationError(f"callback_url {reason}.")


# no whitespace nor control character anywhere (url_policy.url_error says so in words for the rest)
URL_PATTERN = "^https?://[^/?#\\s\\x00-\\x1f\\x7f-\\x9f]+[^\\s\\x00-\\x1f\\x7f-\\x9f]*$"


def CallbackUrl(where: str = "Where the call's events go (each one callback_urls does not send elsewhere)",
                **kwargs: Any) -> fields.String:  # noqa: N802
    return fields.String(
        validate=[validate.Length(min=1, max=2000), _allowed_callback_url],
        metadata={"description": f"{where}; its host must be in VOICE_TOOLS_CALLBACK_HOSTS",
                  "format": "uri", "pattern": URL_PATTERN},
        **kwargs,
    )


def _event_url(kind: str) -> fields.String:
    return CallbackUrl(f"Where the call's {kind} events go, instead of callback_url")


class CallbackUrls(Strict):
    """A URL per event (a relay written for the n8n workflows: /tool-progress, /tool-checkpoint, /tool-complete)."""

    urls = ("progress", "checkpoint", "completed", "failed", "cancelled", "expired")

    progress = _event_url("progress")
    checkpoint = _event_url("checkpoint")
    completed = _event_url("completed")
    failed = _event_url("failed")
    cancelled = _event_url("cancelled")
    expired = _event_url("expired")


def CallbackUrlsField(**kwargs: Any) -> fields.Nested:  # noqa: N802
    return fields.Nested(CallbackUrls, metadata={
        "description": "A callback URL per event (progress, checkpoint, completed, failed, cancelled, expired); "
                       "events not named here go to callback_url"}, **kwargs)


UNKNOWN_TOOL = "Unknown tool"


def unknown_tool_message(name: str) -> str:
    return f"{UNKNOWN_TOOL} {name!r}. Known tools: {', '.join(tools.names())}."


# -- requests ---------------------------------------------------------------------

class PendingRequest(Strict):
    """Body of POST /voice-tools/pending and /voice-tools/execute."""

    session_id = Identifier(required=True, metadata={"description": "The relay's session"})
    function = ShortText(metadata={"description": "The tool's name (or function_name)"})
    function_name = ShortText(metadata={"description": "The tool's name"})
    parameters = fields.Dict(keys=fields.String(), load_default=dict,
                             metadata={"description": "The tool's arguments, checked against its schema"})
    tool_call_id = Identifier(metadata={"description": "The relay's id for the call (tc_ + 12 hex if omitted)"})
    connection_id = ShortText()
    intent_id = ShortText()
    callback_url = CallbackUrl()
    callback_urls = CallbackUrlsField()
    idempotency_key = ShortText(200, metadata={"description": "Or the Idempotency-Key header"})

    @post_load
    def _resolve_tool(self, data: dict[str, Any], **_: Any) -> dict[str, Any]:
        """Find the tool and load the parameters with its schema (defaults filled)."""
        given = {key: data[key] for key in ("function", "function_name") if key in data}
        if not given:
            raise ValidationError({"function": ["Name the tool in function or function_name."]})
        if len(set(given.values())) > 1:
            raise ValidationError({"function_name": ["function and function_name name different tools."]})
        field, name = next(iter(given.items()))
        tool = tools.get(name)
        if tool is None:
            raise ValidationError({field: [unknown_tool_message(name)]})
        try:
            parameters = instance(tool.schema).load(data["parameters"])
        except ValidationError as exc:
            raise ValidationError({"parameters": exc.messages}) from exc
        data.pop("function", None)
        data.update(function_name=tool.name, tool=tool, parameters=parameters)
        return data


ENVELOPE_FIELDS = ("session_id", "intent_id", "callback_url", "callback_urls", "tool_call_id", "connection_id",
                   "idempotency_key")


def flat_request_schema(tool: tools.Tool) -> type[Strict]:
    """The flat body of a tool's legacy alias endpoint: envelope fields and the tool's arguments side by side."""
    declared = dict(PendingRequest._declared_fields)
    envelope = {name: declared[name] for name in ENVELOPE_FIELDS}
    arguments = dict(tool.schema._declared_fields)
    camel = "".join(part.title() for part in tool.name.split("_"))
    return Strict.from_dict({**arguments, **envelope}, name=f"{camel}FlatRequest")


def split_flat(data: dict[str, Any], tool: tools.Tool) -> dict[str, Any]:
    """A loaded flat body as a pending body."""
    envelope = {key: data[key] for key in ENVELOPE_FIELDS if key in data}
    parameters = {key: value for key, value in data.items() if key not in ENVELOPE_FIELDS}
    return {**envelope, "function": tool.name, "parameters": parameters}


class ModifyRequest(Strict):
    parameters = fields.Dict(keys=fields.String(), required=True,
                             metadata={"description": "Fields to change; null removes an optional field"})


class ConfirmRequest(Strict):
    callback_url = CallbackUrl()
    callback_urls = CallbackUrlsField()


class ResumeRequest(Strict):
    action = fields.String(required=True, validate=validate.OneOf(["proceed", "cancel"]))
    reason = ShortText(500)


class CancelRequest(Strict):
    reason = ShortText(500, metadata={"description": "Why (default 'Cancelled by user'; with an admin token "
                                                     "'Cancelled by an operator')"})


class WaitQuery(Strict):
    wait = fields.Float(validate=validate.Range(min=0, max=30, min_inclusive=False),
                        metadata={"description": "Seconds (more than 0, at most 30) to wait for PREPARED or a "
                                                 "terminal status", "exclusiveMinimum": True})


class ContextQuery(Strict):
    limit = fields.Integer(load_default=10, validate=validate.Range(min=1, max=100))


class SessionContextQuery(Strict):
    session_id = Identifier(required=True)
    context_key = ShortText(required=True)


class ToolsQuery(Strict):
    format = fields.String(load_default="realtime", validate=validate.OneOf(["realtime", "chat"]))


class SessionPath(Strict):
    session_id = Identifier(required=True)


class ToolCallPath(Strict):
    tool_call_id = Identifier(required=True)


# -- answers ----------------------------------------------------------------------

def offered(call: Any) -> list[str]:
    """What a call (a row, or its mapping) offers: ``models.events.offers`` of its status and point of no return,
    as its events say."""
    if isinstance(call, Mapping):
        return events.offers(call["status"], call["committed_at"] is not None)[0]
    return events.offers(call.status, call.committed_at is not None)[0]


class PendingAnswer(Schema):
    tool_call_id = fields.String()
    status = fields.String()
    function_name = fields.String()
    parameters = fields.Dict()
    message = fields.String()
    confirmation_message = fields.String()
    actions_available = fields.List(fields.String())


class Change(Schema):
    field = fields.String()
    old = fields.Raw(allow_none=True)
    new = fields.Raw(allow_none=True)


class ModifyAnswer(Schema):
    tool_call_id = fields.String()
    status = fields.String()
    updated_parameters = fields.Dict()
    changes = fields.List(fields.Nested(Change))
    message = fields.String()


class StartAnswer(Schema):
    """202 of confirm / execute / resume: what happens next."""

    tool_call_id = fields.String()
    status = fields.String()
    function_name = fields.String()
    workflow_id = fields.String(allow_none=True)
    message = fields.String()


class CancelAnswer(Schema):
    tool_call_id = fields.String()
    status = fields.String()
    voice_response = fields.String(allow_none=True)
    error_message = fields.String(allow_none=True)


class ParameterChange(Change):
    at = fields.String()


class StatusEntry(Schema):
    status = fields.String()
    at = fields.String()
    reason = fields.String(allow_none=True)
    fields_ = fields.List(fields.String(), data_key="fields")
    by = fields.String(metadata={"description": "Who acted: the token's name (the operator's user name on the CLI, "
                                                "the sweep's name for beat, relay for a callback's answer); absent "
                                                "on a step the call's chain took itself"})
    via = fields.String(metadata={"enum": list(FACES), "description": "The face the action came through"})
    again_of = fields.String(metadata={"description": "On a call run again from the console: the FAILED call it "
                                                      "runs again"})
    run_again_as = fields.String(metadata={"description": "On a FAILED call run again: the new call that runs it"})
    redelivered = fields.List(fields.String(), metadata={
        "description": "On an entry noting that callback events were sent again (its status the call's, unchanged): "
                       "their event_ids"})


class CallRecord(Schema):
    """The whole record of a call (GET /voice-tools/status/{id} and ``?wait=``)."""

    @pre_dump
    def _by_name(self, call: Any, **_kwargs: Any) -> Any:
        """A row (SQLAlchemy's, or ``models.compiled``'s) as its mapping: marshmallow reads a row (a tuple) by
        ``row[name]`` first, a TypeError caught for every field of every row, before its attribute (half the
        dump of a context's 20 rows)."""
        mapping = getattr(call, "_mapping", None)
        return call if mapping is None else mapping

    tool_call_id = fields.String()
    session_id = fields.String()
    connection_id = fields.String(allow_none=True)
    intent_id = fields.String(allow_none=True)
    idempotency_key = fields.String(allow_none=True)
    function_name = fields.String()
    action_level = fields.String()
    parameters = fields.Dict()
    parameters_history = fields.List(fields.Nested(ParameterChange))
    status = fields.String()
    status_history = fields.List(fields.Nested(StatusEntry))
    actions_available = fields.Function(offered, dump_only=True)
    current_step = fields.String(allow_none=True)
    progress = fields.Float()
    result = fields.Dict(allow_none=True)
    voice_response = fields.String(allow_none=True)
    error_message = fields.String(allow_none=True)
    outcome = fields.String(allow_none=True, metadata={
        "enum": ["done", "not_done", "unconfirmed", None],
        "description": "Whether the call's action happened, once it has ended: done, not_done, or unconfirmed "
                       "(it may have happened; the voice_response says to check). Null while the call is open."})
    context_key = fields.String(allow_none=True)
    callback_url = fields.String(allow_none=True)
    callback_urls = fields.Dict(keys=fields.String(), values=fields.String(), allow_none=True)
    workflow_id = fields.String(allow_none=True)
    attempts = fields.Integer()
    redrives = fields.Integer()
    caller = fields.String(allow_none=True)
    committed_at = fields.DateTime(allow_none=True)
    created_at = fields.DateTime()
    confirmed_at = fields.DateTime(allow_none=True)
    executed_at = fields.DateTime(allow_none=True)
    prepared_at = fields.DateTime(allow_none=True)
    resumed_at = fields.DateTime(allow_none=True)
    completed_at = fields.DateTime(allow_none=True)
    execution_time_ms = fields.Integer(allow_none=True)


class ContextItem(CallRecord):
    """A call as the context endpoint lists it: what the assistant needs to speak of it."""

    class Meta:
        fields = ("tool_call_id", "function_name", "parameters", "parameters_history", "status",
                  "current_step", "result", "voice_response", "error_message", "context_key",
                  "created_at", "confirmed_at", "completed_at", "execution_time_ms")


class ContextAnswer(Schema):
    session_id = fields.String()
    pending = fields.List(fields.Nested(ContextItem))
    recent = fields.List(fields.Nested(ContextItem))


class SessionContextAnswer(Schema):
    session_id = fields.String()
    context_key = fields.String()
    context = fields.Dict()
    expires_at = fields.DateTime(allow_none=True)


class LegacyContextAnswer(Schema):
    """GET /get-session-context (a legacy alias): ``{context}``."""

    context = fields.Dict()


class ToolFunction(Schema):
    name = fields.String()
    description = fields.String()
    parameters = fields.Dict()


class ToolDefinition(Schema):
    """``realtime``: type/name/description/parameters; ``chat``: type + function."""

    type = fields.String()
    name = fields.String()
    description = fields.String()
    parameters = fields.Dict()
    function = fields.Nested(ToolFunction)


class ToolsAnswer(Schema):
    format = fields.String()
    tools = fields.List(fields.Nested(ToolDefinition))


class ErrorAnswer(Schema):
    error = fields.String()
    message = fields.String()
    details = fields.Dict()


class HealthAnswer(Schema):
    status = fields.String()
    version = fields.String(metadata={"description": "This process's release (semantic version)"})


class ReadyAnswer(Schema):
    status = fields.String()
    checks = fields.Dict(keys=fields.String(), values=fields.String())


# -- callback events: the body models/events.py builds (docs/relay-guide.md, Event fields) ----------

EVENT_DESCRIPTIONS = {
    "progress": "A step ran (a checkpoint step sends `checkpoint` instead, the last step `completed`)",
    "checkpoint": "The chain stopped at a checkpoint (PREPARED): proceed or cancel at `resume_url`",
    "completed": "The call completed: `result`, `voice_response`",
    "failed": "The call failed: `voice_response` says what did or did not happen, `outcome` whether it was done",
    "cancelled": "The call was cancelled",
    "expired": "The call expired, unconfirmed or not resumed in time",
}


class EventBody(Schema):
    """A callback's body, and an event stream frame's data (without sent_at)."""

    event_id = fields.String(required=True, metadata={
        "description": "Unique per event (32 hex); the same on every delivery attempt and on the event stream "
                       "(the webhook-id header): drop duplicates by it", "pattern": "^[0-9a-f]{32}$"})
    type = fields.String(required=True, validate=validate.OneOf(["tool_status"]))
    event = fields.String(required=True, validate=validate.OneOf(list(events.KINDS)), metadata={
        "description": "The kind of event"})
    tool_call_id = fields.String(required=True)
    intent_id = fields.String(required=True, allow_none=True)
    session_id = fields.String(required=True)
    function_name = fields.String(required=True, metadata={"description": "The call's tool"})
    parameters = fields.Dict(required=True, metadata={"description": "The call's parameters"})
    status = fields.String(required=True, validate=validate.OneOf(list(STATUSES)), metadata={
        "description": "The call's status as this event leaves it"})
    step = fields.String(required=True, allow_none=True, metadata={
        "description": "The step's name (PREPARING, READY_TO_SEND, ...)"})
    gate = fields.Integer(required=True, allow_none=True, metadata={"description": "The step's number, from 1"})
    progress = fields.Float(required=True, allow_none=True, metadata={"description": "0 to 1"})
    message = fields.String(required=True, metadata={"description": "The step's sentence"})
    cancellable = fields.Boolean(required=True, metadata={"description": "Whether a cancel can still stop the call"})
    requires_confirmation = fields.Boolean(required=True, metadata={"description": "True at a checkpoint"})
    preview = fields.Dict(required=True, allow_none=True, metadata={
        "description": "At a checkpoint: what will happen (e.g. to, subject, body)"})
    resume_url = fields.String(required=True, allow_none=True, metadata={
        "description": "At a checkpoint: where to POST {\"action\": \"proceed\"} (or cancel)"})
    actions_available = fields.List(fields.String(validate=validate.OneOf(["confirm", "modify", "cancel",
                                                                           "proceed"])), required=True)
    result = fields.Dict(required=True, allow_none=True)
    voice_response = fields.String(required=True, allow_none=True, metadata={
        "description": "What the assistant says"})
    execution_time_ms = fields.Integer(required=True, allow_none=True)
    outcome = fields.String(required=True, allow_none=True, validate=validate.OneOf(["done", "not_done",
                                                                                      "unconfirmed"]), metadata={
        "description": "Null until the call ends, then done, not_done or unconfirmed"})
    context_available = fields.Boolean(required=True, metadata={"description": "A context was stored for the "
                                                                               "session"})
    context_key = fields.String(required=True, allow_none=True)
    seq = fields.Integer(required=True, metadata={
        "description": "The call's events counted 1, 2, 3 ... with no gaps, whichever URL they go to"})
    sent_at = fields.DateTime(metadata={"description": "When this delivery attempt was sent (callbacks only; not "
                                                       "on the event stream)"})
    trace_id = fields.String(metadata={"description": "Only when the server traces (OpenTelemetry): the call's "
                                                      "trace id", "pattern": "^[0-9a-f]{32}$"})
    span_id = fields.String(metadata={"description": "Only when the server traces: the span that made the event",
                                      "pattern": "^[0-9a-f]{16}$"})


def _event_schema(kind: str) -> type[Schema]:
    """The body of one kind of event: ``event`` is that kind, ``status`` the call's status in it."""
    extra: dict[str, Any] = {
        "event": fields.String(required=True, validate=validate.OneOf([kind]), metadata={
            "description": "The kind of event"}),
        "status": fields.String(required=True, validate=validate.OneOf([events.STATUS_OF[kind]]), metadata={
            "description": "The call's status as this event leaves it"}),
    }
    if kind == "checkpoint":  # the names a relay's /tool-checkpoint handler reads
        extra["checkpoint"] = fields.String(required=True, metadata={"description": "The checkpoint's step"})
        extra["resume_webhook"] = fields.String(required=True, metadata={"description": "= resume_url"})
    name = "".join(part.title() for part in kind.split("_")) + "Event"
    schema = type(name, (EventBody,), {**extra, "__doc__": EVENT_DESCRIPTIONS[kind]})
    return schema


EVENT_SCHEMAS: dict[str, type[Schema]] = {kind: _event_schema(kind) for kind in events.KINDS}


class EventAnswer(Schema):
    """The relay's answer to a callback: `{"cancel": true, "reason": ...}` cancels a cancellable `progress` or a
    `checkpoint` event's call; anything else (`{"received": true}`, an empty body, an error status) lets it go on"""

    cancel = fields.Boolean(metadata={"description": "True: cancel the call (a cancellable progress or a "
                                                     "checkpoint event)"})
    reason = fields.String(metadata={"description": "Why, recorded as the cancel's reason"})
    received = fields.Boolean()

    class Meta:
        unknown = INCLUDE
