"""The OpenAPI document (GET /openapi.json), generated from the marshmallow schemas.

Each view says what it takes and answers with :func:`doc`; :func:`build` walks the
app's URL map, so every route is listed, and apispec's marshmallow plugin turns the
schemas into components. The document then states the rules the loaders enforce that
apispec does not carry over: PendingRequest as one variant per tool (the tool named and
its own parameters), every request string's TEXT_PATTERN (``schemas.Strict``), a body
with a required field required; and in words (RULES) what a schema cannot say. It also
describes every callback event (:func:`_describe_events`): one schema per kind, the OpenAPI 3.0
``callbacks`` of every operation that takes a callback URL, the signature headers.
tests/test_api_schemathesis.py holds the server to it; tests/test_openapi.py validates it and
holds the events sent to their schemas.
"""
from __future__ import annotations

import copy
import re
from typing import Any, Callable

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Flask
from marshmallow import Schema

from tasks.calls import schemas
from app.limits import MAX_HEADER_BYTES, MAX_HEADER_FIELDS, MAX_REQUEST_LINE
from tasks import tools

_PATH_ARG = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")
_ERRORS = {
    "400": "Bad JSON", "401": "Missing or unknown token", "404": "Unknown tool call (or another caller's)",
    "409": "Not allowed in the call's current status", "413": "Body over 256 KiB",
    "414": f"Request line (method, path and query string) over {MAX_REQUEST_LINE} bytes",
    "422": "Invalid fields", "431": f"A header over {MAX_HEADER_BYTES} bytes, or more than {MAX_HEADER_FIELDS} headers",
    "503": "Database or broker unavailable",
}
# every operation but /healthz: the caller's fair share (app/shares.py)
_LIMITED = {
    "description": "Past the caller's share, nothing done: `rate_limited` (its requests per period) or "
                   "`too_many_open` (an event stream or a ?wait past the ?wait requests and streams it may hold "
                   "at once); try again after Retry-After",
    "headers": {"Retry-After": {"description": "Seconds to wait before trying again",
                                "schema": {"type": "integer", "minimum": 1}}},
}

# What every request string must match: no NUL nor other control character (C0 but tab, newline
# and carriage return; DEL; C1) (schemas.Strict refuses them anywhere in a request).
TEXT_PATTERN = "^[^\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f]*$"

RULES = (
    "What the schemas below cannot say: field names, and the strings inside free-form objects, follow the "
    "rule every request string's pattern states (no NUL nor other control character, DEL and C1 too, but tab, "
    "newline and carriage return); a body is UTF-8 with no byte order mark; a callback URL holds no whitespace "
    "nor control or format character (Unicode's too; "
    "percent-encode them) and its host must be in the server's VOICE_TOOLS_CALLBACK_HOSTS "
    "(configuration: a URL the schema allows may be refused with 422); a JSON object that gives a key twice is "
    "400 bad_json naming it; `parameters` of /voice-tools/modify "
    "are checked against the parameters of the call's own tool; a pending or execute body may name its tool "
    "in `function_name` alone instead of `function` (the older form; given both, they must agree); a tool's "
    "`reference_context` must name a "
    "session context stored for the session; the dates, times and time zones of tool parameters must be "
    f"readable (ISO 8601, IANA names). The request line is at most {MAX_REQUEST_LINE} bytes (414), a header "
    f"at most {MAX_HEADER_BYTES} bytes and at most {MAX_HEADER_FIELDS} headers (431), a body at most 256 KiB "
    "(413). Every error is JSON {error, message, details}; OPTIONS is a 405 naming the allowed methods. Each caller "
    "has a share (429 past it, with Retry-After): a rate of requests, and a number of ?wait requests and event "
    "streams held at once (docs/relay-guide.md, Limits and small rules)."
)


# the groups of operations (a generated client's modules: ``calls.confirm``), each operation in one
TAGS = {
    "calls": "A call's life (record, modify, confirm, execute, resume, cancel) and reading calls and session "
             "context",
    "tools": "The tools this service runs",
    "events": "A session's events as a stream",
    "meta": "Liveness, readiness, metrics and this document",
}
COMPATIBILITY = ("Kept so that a relay written for the n8n workflows works unchanged; new relays use {canonical}, "
                 "which does the same.")


def doc(summary: str, *, tag: str, body: type[Schema] | None = None, query: type[Schema] | None = None,
        responses: dict[int, type[Schema] | str | tuple] | None = None, public: bool = False,
        instead: str | None = None) -> Callable:
    """Describe a view for the OpenAPI document (no effect on how it runs): ``tag`` its group (one of
    ``TAGS``); ``instead``, for a legacy endpoint kept for older relays, what new relays use (it is
    marked deprecated). An answer that is not JSON is a description (text/plain) or ``(media type,
    description[, schema])``."""
    if tag not in TAGS:
        raise ValueError(f"tag {tag!r} is not one of {sorted(TAGS)}")

    def mark(view: Callable) -> Callable:
        view.openapi = {  # type: ignore[attr-defined]
            "summary": summary, "tag": tag, "body": body, "query": query, "responses": responses or {},
            "public": public, "instead": instead,
        }
        return view
    return mark


# the schema each path argument is loaded with (so its pattern and length are documented)
_PATH_SCHEMAS: dict[str, type[Schema]] = {"tool_call_id": schemas.ToolCallPath, "session_id": schemas.SessionPath}


def _operation(meta: dict[str, Any], path_args: list[str]) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": meta["summary"], "tags": [meta["tag"]]}
    if meta.get("instead"):
        operation["deprecated"] = True
        operation["description"] = COMPATIBILITY.format(canonical=meta["instead"])
    parameters: list[dict[str, Any]] = [
        {"in": "path", "schema": _PATH_SCHEMAS[name]} if name in _PATH_SCHEMAS
        else {"in": "path", "name": name, "required": True, "schema": {"type": "string"}}
        for name in path_args
    ]
    if meta.get("query"):
        parameters.append({"in": "query", "schema": meta["query"]})
    if parameters:
        operation["parameters"] = parameters
    if meta.get("body"):
        operation["requestBody"] = {"content": {"application/json": {"schema": meta["body"]}}}
    responses: dict[str, Any] = {}
    for status, answer in meta.get("responses", {}).items():
        if isinstance(answer, (str, tuple)):
            media, description, body = (*answer, {"type": "string"})[:3] if isinstance(answer, tuple) \
                else ("text/plain", answer, {"type": "string"})
            responses[str(status)] = {"description": description, "content": {media: {"schema": body}}}
        else:
            responses[str(status)] = {"description": answer.__doc__ or answer.__name__,
                                      "content": {"application/json": {"schema": answer}}}
    for status, description in _ERRORS.items():
        responses.setdefault(status, {"description": description,
                                      "content": {"application/json": {"schema": schemas.ErrorAnswer}}})
    if not meta.get("public"):
        responses.setdefault("429", {**copy.deepcopy(_LIMITED),
                                     "content": {"application/json": {"schema": schemas.ErrorAnswer}}})
    operation["responses"] = responses
    if not meta.get("public"):
        operation["security"] = [{"bearer": []}]
    return operation


def alias_of(endpoint: str, app: Flask) -> str | None:
    """The canonical path an n8n-compatible route stands for (None: it is canonical itself)."""
    if not endpoint.startswith("n8n."):
        return None
    name = "resume" if endpoint == "n8n.resume_execution" else endpoint.split(".", 1)[1]
    rule = next(r for r in app.url_map.iter_rules() if r.endpoint == f"api.{name}")
    return _PATH_ARG.sub(r"{\1}", rule.rule)


def operation_id(endpoint: str, method: str | None = None) -> str:
    """An operation's id, from its view's name in camelCase (``api.session_context``: sessionContext);
    an n8n-compatible alias's begins with ``webhook`` (webhookSessionContext); ``method`` is added when
    one route takes several."""
    blueprint, name = endpoint.split(".", 1)
    words = [word for word in name.split("_") if word]
    if blueprint == "n8n":
        words.insert(0, "webhook")
    if method:
        words.append(method.lower())
    return words[0] + "".join(word.title() for word in words[1:])


def build(app: Flask) -> dict[str, Any]:
    spec = APISpec(
        title="voice-tools", version="0.1.0", openapi_version="3.0.3", plugins=[MarshmallowPlugin()],
        info={"description": "Runs the tool calls of a voice assistant (how to call it: docs/relay-guide.md; what it "
                             f"promises: docs/promises.md). {RULES}"},
    )
    for name, description in TAGS.items():
        spec.tag({"name": name, "description": description})
    for tool in tools.TOOLS.values():
        spec.components.schema(tool.schema.__name__, schema=tool.schema)
    for event_schema in schemas.EVENT_SCHEMAS.values():
        spec.components.schema(event_schema.__name__, schema=event_schema)
    spec.components.schema("EventAnswer", schema=schemas.EventAnswer)
    spec.components.security_scheme("bearer", {
        "type": "http", "scheme": "bearer",
        "description": "A token of VOICE_TOOLS_API_TOKENS (name:token[:admin]). A caller sees and acts on only "
                       "the calls, session context and events its token name created (another caller's are "
                       "404, as unknown); an :admin token sees everything."})
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.endpoint.startswith("console_"):  # the console is a face of its own
            continue
        meta = getattr(app.view_functions[rule.endpoint], "openapi", None)
        if meta is None:
            raise ValueError(f"the view of {rule.rule} is not described: give it app.openapi.doc(...)")
        path = _PATH_ARG.sub(r"{\1}", rule.rule)
        canonical = alias_of(rule.endpoint, app)
        methods = sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})
        for method in methods:
            operation = _operation(meta, sorted(rule.arguments))
            operation["operationId"] = operation_id(rule.endpoint, method if len(methods) > 1 else None)
            if canonical:  # an n8n-compatible path: grouped with the operation it stands for, deprecated
                operation["summary"] = f"n8n-compatible alias of {canonical}: {operation['summary']}"
                operation["x-alias-of"] = canonical
                operation["deprecated"] = True
                operation["description"] = COMPATIBILITY.format(canonical=meta.get("instead") or canonical)
            paths.setdefault(path, {})[method.lower()] = operation
    ids = [operation["operationId"] for item in paths.values() for operation in item.values()]
    if len(ids) != len(set(ids)):
        raise ValueError(f"operationIds used twice: {sorted({i for i in ids if ids.count(i) > 1})}")
    for path in sorted(paths):
        spec.path(path=path, operations=paths[path])
    document = spec.to_dict()
    components = document["components"]["schemas"]
    _pending_per_tool(components)
    marked: set[str] = set()  # the components already marked
    for path_item in document["paths"].values():
        for operation in path_item.values():
            _state_request_rules(operation, components, marked)
    _describe_events(document)
    return document


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _pending_per_tool(components: dict[str, Any]) -> None:
    """PendingRequest as one typed variant per tool, discriminated by ``function`` (the tool's name):
    that tool's own parameters (its schema in the tool registry), so a body the document allows names
    a tool and fits it, and a generated client has one type per tool. ``function_name`` may repeat
    the name; a body naming its tool in ``function_name`` alone is accepted too (RULES says so)."""
    base = components["PendingRequest"]
    mapping = {}
    for name in tools.names():
        tool = tools.TOOLS[name]
        variant = copy.deepcopy(base)
        variant["properties"]["function"] = {**variant["properties"]["function"], "enum": [name],
                                             "description": "The tool's name: this variant's"}
        variant["properties"]["function_name"] = {**variant["properties"]["function_name"], "enum": [name],
                                                  "description": "The tool's name again (optional; the same)"}
        parameters = tool.schema.__name__
        variant["properties"]["parameters"] = {"description": f"The arguments of {name}", "allOf": [_ref(parameters)]}
        required = [*variant.get("required", []), "function"]
        if components[parameters].get("required"):
            required.append("parameters")
        variant["required"] = required
        variant["description"] = f"A call of {name}"
        variant_name = "Pending" + "".join(part.title() for part in name.split("_"))
        components[variant_name] = variant
        mapping[name] = _ref(variant_name)["$ref"]
    components["PendingRequest"] = {
        "description": "A tool call: one variant per tool, chosen by `function`",
        "oneOf": [{"$ref": ref} for ref in mapping.values()],
        "discriminator": {"propertyName": "function", "mapping": mapping},
    }


def _state_request_rules(operation: dict[str, Any], components: dict[str, Any], seen: set[str]) -> None:
    """A request body with required fields is required; every request string states TEXT_PATTERN."""
    body = operation.get("requestBody")
    if body:
        schema = body["content"]["application/json"]["schema"]
        resolved = _resolve(schema, components)
        if resolved.get("required") or resolved.get("oneOf"):
            body["required"] = True
        _mark_text(schema, components, seen)
    for parameter in operation.get("parameters", []):
        _mark_text(parameter.get("schema", {}), components, seen)


def _resolve(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return components[ref.rsplit("/", 1)[1]] if ref else schema


def _mark_text(schema: Any, components: dict[str, Any], seen: set[str]) -> None:
    if not isinstance(schema, dict):
        return
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[1]
        if name not in seen:
            seen.add(name)
            _mark_text(components[name], components, seen)
        return
    if schema.get("type") == "string" and "enum" not in schema:
        if "pattern" not in schema:
            schema["pattern"] = TEXT_PATTERN
        elif not schema["pattern"].startswith("^") and {"pattern": TEXT_PATTERN} not in schema.get("allOf", []):
            schema.setdefault("allOf", []).append({"pattern": TEXT_PATTERN})  # a pattern found anywhere (\\S)
    for sub in schema.get("properties", {}).values():
        _mark_text(sub, components, seen)
    for key in ("items", "additionalProperties"):
        _mark_text(schema.get(key), components, seen)
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key, []):
            _mark_text(sub, components, seen)


# The signature headers of every callback (docs/relay-guide.md, Headers and signature)
SIGNATURE_HEADERS: dict[str, str] = {
    "webhook-id": "Standard Webhooks: the event's event_id (the same on every attempt)",
    "webhook-timestamp": "Standard Webhooks: Unix seconds when the attempt was made",
    "webhook-signature": "Standard Webhooks: `v1,<base64 HMAC-SHA256 of \"<webhook-id>.<webhook-timestamp>.<body>\">`, "
                         "one per secret of VOICE_TOOLS_CALLBACK_SECRETS (whsec_...), space-separated, newest first; "
                         "sent when that variable is set",
    "X-Voice-Tools-Event": "The older scheme: the kind of event",
    "X-Voice-Tools-Event-Id": "The older scheme: the event's event_id",
    "X-Voice-Tools-Timestamp": "The older scheme: Unix seconds when the attempt was made",
    "X-Voice-Tools-Signature": "The older scheme: `sha256=<hex HMAC-SHA256 of \"<timestamp>.<body>\">` keyed with "
                               "VOICE_TOOLS_CALLBACK_SECRET",
}
_HEADER_PATTERNS = {"webhook-id": "^[0-9a-f]{32}$", "webhook-timestamp": "^[0-9]+$",
                    "webhook-signature": "^v1,[A-Za-z0-9+/]+=*( v1,[A-Za-z0-9+/]+=*)*$",
                    "X-Voice-Tools-Event-Id": "^[0-9a-f]{32}$", "X-Voice-Tools-Timestamp": "^[0-9]+$",
                    "X-Voice-Tools-Signature": "^sha256=[0-9a-f]{64}$"}
_ALWAYS_SENT = {"X-Voice-Tools-Event", "X-Voice-Tools-Event-Id", "X-Voice-Tools-Timestamp", "X-Voice-Tools-Signature"}


def _header_parameter_name(header: str) -> str:
    return "Header" + "".join(part.title() for part in re.split(r"[-_]", header))


def _describe_events(document: dict[str, Any]) -> None:
    """The events: one schema per kind (``schemas.EVENT_SCHEMAS``) and their union ``CallbackEvent``
    (discriminated by ``event``); the callbacks every operation taking a callback URL makes (OpenAPI
    3.0 ``callbacks``: to ``callback_url``, and to ``callback_urls.<kind>``), with the signature
    headers; the event stream's frames, whose data is the same body."""
    components = document["components"]
    mapping = {kind: _ref(schema.__name__)["$ref"] for kind, schema in schemas.EVENT_SCHEMAS.items()}
    for kind, schema in schemas.EVENT_SCHEMAS.items():
        components["schemas"][schema.__name__]["description"] = schemas.EVENT_DESCRIPTIONS[kind]
    components["schemas"]["CallbackEvent"] = {
        "description": "A callback's body (and an event stream frame's data): one schema per kind of event",
        "oneOf": [{"$ref": ref} for ref in mapping.values()],
        "discriminator": {"propertyName": "event", "mapping": mapping},
    }
    components["schemas"]["EventAnswer"]["description"] = (schemas.EventAnswer.__doc__ or "").replace("\n    ", " ")
    parameters = components.setdefault("parameters", {})
    for header, description in SIGNATURE_HEADERS.items():
        schema: dict[str, Any] = {"type": "string"}
        if header in _HEADER_PATTERNS:
            schema["pattern"] = _HEADER_PATTERNS[header]
        if header == "X-Voice-Tools-Event":
            schema["enum"] = list(schemas.EVENT_SCHEMAS)
        parameters[_header_parameter_name(header)] = {
            "in": "header", "name": header, "required": header in _ALWAYS_SENT,
            "description": description, "schema": schema}
    headers = [{"$ref": f"#/components/parameters/{_header_parameter_name(h)}"} for h in SIGNATURE_HEADERS]

    def delivery(summary: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"post": {
            "summary": summary, "parameters": headers,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "Received (any 2xx); the answer may cancel the call",
                                  "content": {"application/json": {"schema": _ref("EventAnswer")}}},
                          "default": {"description": "Not received: the delivery is retried with backoff"}},
        }}

    callbacks: dict[str, Any] = {
        "{$request.body#/callback_url}": delivery(
            "Every event of the call that callback_urls does not send elsewhere", _ref("CallbackEvent")),
    }
    for kind, schema in schemas.EVENT_SCHEMAS.items():
        callbacks[f"{{$request.body#/callback_urls/{kind}}}"] = delivery(
            f"The call's {kind} events, when callback_urls names a URL for them", _ref(schema.__name__))
    for path_item in document["paths"].values():
        for operation in path_item.values():
            if _takes_callback_url(operation, components["schemas"]):
                # written out in each operation, not a $ref to components.callbacks: generators
                # (openapi-python-client) read no reference there
                operation["callbacks"] = {"events": copy.deepcopy(callbacks)}


def _takes_callback_url(operation: dict[str, Any], components: dict[str, Any]) -> bool:
    body = operation.get("requestBody")
    if not body:
        return False
    schema = _resolve(body["content"]["application/json"]["schema"], components)
    variants = [_resolve(variant, components) for variant in schema.get("oneOf", [])] or [schema]
    return all("callback_url" in variant.get("properties", {}) for variant in variants)
