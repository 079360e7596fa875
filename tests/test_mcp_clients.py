"""What an MCP client reads of the server, read with the SDK's own client.

The JSON Schemas the faces hand to clients are JSON Schema 2020-12, as MCP and the model APIs
read them: a client or model provider that checks a tool's schema drops a tool whose schema its validator
refuses. The schemas are read as a client reads them (over MCP with the SDK's own client, from
``GET /voice-tools/tools``) and checked with ``jsonschema``'s 2020-12 validator; each one is
then asked what it says about the ``wait`` bound, so the schema means what the server enforces.
The server names itself with the package's version and offers what it has (tools) only.
"""
from __future__ import annotations

import json

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


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_server_says_its_version_and_offers_tools_only(mcp_url, mode):  # noqa: F811
    """What a client shows a person: the server's name and the package's version, and only the
    capability it has (tools; no prompts, no resources, no completions, no logging)."""
    from importlib.metadata import version

    async with connected(mcp_url, mode=mode) as mcp:
        info, capabilities = mcp.server_info, mcp.server_capabilities
        assert (await mcp.list_tools()).tools
    assert info is not None and info.name == "voice-tools"
    assert info.version == version("voice-tools") and info.version
    offered = {name for name, value in capabilities.model_dump(exclude_none=True).items() if value}
    assert offered == {"tools"}, capabilities


@pytest.mark.anyio
async def test_an_unknown_tool_is_an_error_result_in_the_rest_apis_error_json(mcp_url):  # noqa: F811
    async with connected(mcp_url) as mcp:
        result = await mcp.call_tool("send_fax", {"to": "x"})
    assert result.is_error and json.loads(result.content[0].text) == result.structured_content
    assert result.structured_content["error"] == "not_found"
    assert result.structured_content["details"]["tool"] == "send_fax"
    assert "request_tool" in result.structured_content["details"]["known_tools"]
    assert result.meta["voice-tools/http_status"] == 404
