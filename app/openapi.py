"""The OpenAPI document (GET /openapi.json), generated from the marshmallow schemas.

Each view says what it takes and answers with :func:`doc`; :func:`build` walks the
app's URL map, so every route is listed, and apispec's marshmallow plugin turns the
schemas into components.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Flask
from marshmallow import Schema

from app import schemas

_PATH_ARG = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")
_ERRORS = {
    "400": "Bad JSON", "401": "Missing or unknown token", "404": "Unknown tool call (or another caller's)",
    "409": "Not allowed in the call's current status", "413": "Body over 256 KiB",
    "422": "Invalid fields", "503": "Database or broker unavailable",
}


def doc(summary: str, *, body: type[Schema] | None = None, query: type[Schema] | None = None,
        responses: dict[int, type[Schema] | str] | None = None, public: bool = False) -> Callable:
    """Describe a view for the OpenAPI document (no effect on how it runs)."""
    def mark(view: Callable) -> Callable:
        view.openapi = {  # type: ignore[attr-defined]
            "summary": summary, "body": body, "query": query, "responses": responses or {}, "public": public,
        }
        return view
    return mark


# the schema each path argument is loaded with (so its pattern and length are documented)
_PATH_SCHEMAS: dict[str, type[Schema]] = {"tool_call_id": schemas.ToolCallPath, "session_id": schemas.SessionPath}


def _operation(meta: dict[str, Any], path_args: list[str]) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": meta.get("summary", "")}
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
        if isinstance(answer, str):
            responses[str(status)] = {"description": answer, "content": {"text/plain": {"schema": {"type": "string"}}}}
        else:
            responses[str(status)] = {"description": answer.__doc__ or answer.__name__,
                                      "content": {"application/json": {"schema": answer}}}
    for status, description in _ERRORS.items():
        responses.setdefault(status, {"description": description,
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


def build(app: Flask) -> dict[str, Any]:
    spec = APISpec(
        title="voice-tools", version="0.1.0", openapi_version="3.0.3", plugins=[MarshmallowPlugin()],
        info={"description": "Runs the tool calls of a voice assistant (see README and CONTRACT)."},
    )
    spec.components.security_scheme("bearer", {
        "type": "http", "scheme": "bearer",
        "description": "A token of VOICE_TOOLS_API_TOKENS (name:token[:admin]). A caller sees and acts on only "
                       "the calls, session context and events its token name created (another caller's are "
                       "404, as unknown); an :admin token sees everything."})
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        meta = getattr(app.view_functions[rule.endpoint], "openapi", {"summary": rule.endpoint})
        path = _PATH_ARG.sub(r"{\1}", rule.rule)
        canonical = alias_of(rule.endpoint, app)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            operation = _operation(meta, sorted(rule.arguments))
            if canonical:
                operation["summary"] = f"n8n-compatible alias of {canonical}: {operation['summary']}"
                operation["x-alias-of"] = canonical
            paths.setdefault(path, {})[method.lower()] = operation
    for path in sorted(paths):
        spec.path(path=path, operations=paths[path])
    return spec.to_dict()
