"""Every tool as an OpenAI function definition (GET /voice-tools/tools).

The parameter JSON Schema is generated from the tool's marshmallow schema by
apispec's converter (nested schemas inlined), then cut down to the keys the
Realtime and Chat APIs accept: type, properties, required, enum, description, items.
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


def parameters_schema(tool: tools.Tool) -> dict[str, Any]:
    return only_allowed(converter().schema2jsonschema(tool.schema))


def definition(tool: tools.Tool, fmt: str) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": parameters_schema(tool)}
    if fmt == "chat":
        return {"type": "function", "function": function}
    return {"type": "function", **function}


def definitions(fmt: str = "realtime") -> list[dict[str, Any]]:
    return [definition(tools.TOOLS[name], fmt) for name in tools.names()]
