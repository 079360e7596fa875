"""The JSON Schemas the faces hand to clients are JSON Schema 2020-12, as MCP and the model APIs read them.

A client or model provider that checks a tool's schema drops a tool whose schema its validator
refuses. The schemas are read as a client reads them (over MCP with the SDK's own client, from
``GET /voice-tools/tools``) and checked with ``jsonschema``'s 2020-12 validator; each one is
then asked what it says about the ``wait`` bound, so the schema means what the server enforces.
"""
from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from tests.conftest import AUTH
from tests.test_mcp import anyio_backend, connected, mcp_url  # noqa: F401 (the MCP server of test_mcp)

WAITING = {"confirm_tool", "resume_tool", "execute_tool"}


@pytest.mark.anyio
async def test_every_mcp_input_schema_is_json_schema_2020_12(mcp_url):  # noqa: F811
    async with connected(mcp_url) as mcp:
        faces = {tool.name: tool.input_schema for tool in (await mcp.list_tools()).tools}
        listed = await mcp.call_tool("list_tools", {})
    assert faces and not listed.is_error
    schemas = {**faces, **{f"list_tools:{t['name']}": t["inputSchema"] for t in listed.structured_content["tools"]}}
    for name, schema in schemas.items():
        Draft202012Validator.check_schema(schema)  # raises SchemaError naming the keyword
    assert WAITING <= set(faces)
    for name in WAITING:  # wait: more than 0, at most 30, as the server checks it
        wait = Draft202012Validator(faces[name]["properties"]["wait"])
        assert not wait.is_valid(0) and not wait.is_valid(30.5) and not wait.is_valid(-1), name
        assert wait.is_valid(0.1) and wait.is_valid(30), name


def test_every_tools_function_schema_is_json_schema_2020_12(client):
    for fmt in ("realtime", "chat"):
        listed = client.get(f"/voice-tools/tools?format={fmt}", headers=AUTH).get_json()["tools"]
        assert listed
        for tool in listed:
            function = tool["function"] if fmt == "chat" else tool
            Draft202012Validator.check_schema(function["parameters"])
            assert function["parameters"]["type"] == "object"
