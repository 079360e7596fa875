"""What an MCP client reads of the server, read with the SDK's own client.

The JSON Schemas the faces hand to clients are JSON Schema 2020-12, as MCP and the model APIs
read them: a client or model provider that checks a tool's schema drops a tool whose schema its validator
refuses. The schemas are read as a client reads them (over MCP with the SDK's own client, from
``GET /voice-tools/tools``) and checked with ``jsonschema``'s 2020-12 validator; each one is
then asked what it says about the ``wait`` bound, so the schema means what the server enforces.
ajv, the validator of the MCP TypeScript SDK, checks them too, through Node (``tests/ajv``, its
lock installed with ``npm ci``).
The server names itself with the package's version and offers what it has (tools) only.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from tests.conftest import AUTH
from tests.test_mcp import anyio_backend, connected, mcp_url  # noqa: F401 (the MCP server of test_mcp)

WAITING = {"confirm_tool", "resume_tool", "execute_tool"}
AJV = Path(__file__).parent / "ajv"


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
    from models import release

    async with connected(mcp_url, mode=mode) as mcp:
        info, capabilities = mcp.server_info, mcp.server_capabilities
        assert (await mcp.list_tools()).tools
    assert info is not None and info.name == "voice-tools"
    assert info.version == release.VERSION and info.version
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


@pytest.fixture(scope="module")
def ajv() -> Path:
    """``tests/ajv`` with its locked packages installed (``npm ci`` once)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node and npm are not installed")
    if not (AJV / "node_modules" / "ajv").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=AJV, check=True, capture_output=True, timeout=300)
    return AJV / "check.mjs"


def ajv_problems(check: Path, cases: dict) -> dict:
    done = subprocess.run(["node", str(check)], input=json.dumps(cases), capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1) and done.stdout, done.stderr
    return json.loads(done.stdout)


def test_ajv_tells_the_old_boolean_exclusive_minimum_from_the_2020_12_one(ajv):
    old = {"type": "object", "properties": {"wait": {"type": "number", "minimum": 0, "exclusiveMinimum": True}}}
    problems = ajv_problems(ajv, {"old": {"schema": old}, "new": {
        "schema": {"type": "object", "properties": {"wait": {"type": "number", "exclusiveMinimum": 0}}},
        "valid": [{"wait": 0.5}], "invalid": [{"wait": 0}]}})
    assert list(problems) == ["old"] and "exclusiveMinimum" in problems["old"]


@pytest.mark.slow
@pytest.mark.anyio
async def test_ajv_compiles_every_schema_handed_to_clients(mcp_url, ajv):  # noqa: F811
    """Every MCP inputSchema, every registry tool's inputSchema (list_tools) and every /tools function
    schema compiles under ajv's 2020-12 strict mode, and wait's bound is judged as the server judges it."""
    from app import create_app

    async with connected(mcp_url) as mcp:
        faces = {tool.name: tool.input_schema for tool in (await mcp.list_tools()).tools}
        listed = (await mcp.call_tool("list_tools", {})).structured_content["tools"]
    rest = create_app({"TESTING": True}).test_client()
    functions = rest.get("/voice-tools/tools", headers=AUTH).get_json()["tools"]
    cases = {f"mcp:{name}": {"schema": schema} for name, schema in faces.items()}
    cases |= {f"list_tools:{tool['name']}": {"schema": tool["inputSchema"]} for tool in listed}
    cases |= {f"/tools:{tool['name']}": {"schema": tool["parameters"]} for tool in functions}
    for name in WAITING:
        cases[f"mcp:{name}"] |= {"valid": [{"tool_call_id": "tc_1", "wait": 0.1} | _required(name)],
                                 "invalid": [{"tool_call_id": "tc_1", "wait": 0} | _required(name)]}
    assert len(cases) == len(faces) + 2 * len(listed)
    assert ajv_problems(ajv, cases) == {}


def _required(name: str) -> dict:
    """The other arguments a face's schema requires besides tool_call_id."""
    return {"resume_tool": {"action": "proceed"}, "execute_tool": {"session_id": "s"}}.get(name, {})
