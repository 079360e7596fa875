"""Every tool as an OpenAI function definition (GET /voice-tools/tools), and JSON Schemas of request schemas.

The parameter JSON Schema is generated from the tool's marshmallow schema by
apispec's converter (nested schemas inlined), then cut down to the keys the
Realtime and Chat APIs accept: type, properties, required, enum, description, items.

:func:`json_schema` is the converter's output in JSON Schema 2020-12 (what MCP's
``inputSchema`` is): the converter writes OpenAPI 3.0's forms, whose boolean
``exclusiveMinimum``/``exclusiveMaximum`` and ``nullable`` 2020-12 writes otherwise.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin

from tasks import tools

ALLOWED_KEYS = ("type", "properties", "required", "enum", "description", "items")


def only_allowed(schema: dict[str, Any]) -> dict[str, Any]:
    """Keep ALLOWED_KEYS, recursively (``properties`` maps field names to schemas)."""
    kept: dict[str, Any] = {}
    for key in ALLOWED_KEYS:
        if key not in schema:
            continue
        value = schema[key]
        if key == "properties":
            value = {name: only_allowed(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            value = only_allowed(value)
        kept[key] = value
    if kept.get("type") == "object":
        kept.setdefault("properties", {})
    return kept


@lru_cache(maxsize=1)
def converter():
    plugin = MarshmallowPlugin(schema_name_resolver=lambda schema: None)  # None: inline nested schemas
    APISpec("voice-tools tools", "1", "3.0.3", plugins=[plugin])
    return plugin.converter


def json_schema(schema: Any) -> dict[str, Any]:
    """A marshmallow schema (class or instance) as a JSON Schema 2020-12 document (nested schemas inlined)."""
    return to_2020_12(converter().schema2jsonschema(schema))


def to_2020_12(schema: Any) -> Any:
    """OpenAPI 3.0's schema forms in their JSON Schema 2020-12 spelling, recursively: a boolean
    ``exclusiveMinimum`` (``exclusiveMaximum``) becomes the bound itself in place of ``minimum``
    (``maximum``); ``nullable: true`` adds ``"null"`` to ``type``."""
    if isinstance(schema, list):
        return [to_2020_12(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: to_2020_12(value) for key, value in schema.items()}
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        flag = converted.get(exclusive)
        if isinstance(flag, bool):
            del converted[exclusive]
            if flag and bound in converted:
                converted[exclusive] = converted.pop(bound)
    if converted.pop("nullable", False) is True and "type" in converted:
        types = converted["type"] if isinstance(converted["type"], list) else [converted["type"]]
        converted["type"] = [*types, "null"] if "null" not in types else types
    return converted


def parameters_schema(tool: tools.Tool) -> dict[str, Any]:
    return only_allowed(converter().schema2jsonschema(tool.schema))


def definition(tool: tools.Tool, fmt: str) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": parameters_schema(tool)}
    if fmt == "chat":
        return {"type": "function", "function": function}
    return {"type": "function", **function}


def definitions(fmt: str = "realtime") -> list[dict[str, Any]]:
    return [definition(tools.TOOLS[name], fmt) for name in tools.names()]
