"""The MCP face (docs/relay-guide.md, MCP), through the SDK's own client.

One real server for the module (``create_mcp_app()`` under uvicorn in a thread, on a
free port), spoken to over streamable HTTP by ``mcp.Client``; the in-process worker
runs the calls. Each test shows the MCP face is the REST API's operations: the same
answers, the same error JSON, the same rows, callbacks, idempotency and tokens.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import pytest
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tasks.calls import toolspec
from app.mcp_server import create_mcp_app
from tests.api_fixtures import GUIDE_EMAIL, call_count, snapshot
from tests.conftest import API_TOKEN, AUTH
from tests.helpers import deliveries, row
from tasks import tools

pytestmark = pytest.mark.anyio

MCP_TOKEN = "mcp-token"  # a second token: its name "mcp-client" is recorded as the caller
MCP_AUTH = {"Authorization": f"Bearer {MCP_TOKEN}"}  # the same caller on the REST face
FACES = {"request_tool", "modify_tool", "confirm_tool", "resume_tool", "cancel_tool", "execute_tool",
         "get_status", "get_context", "get_session_context", "list_tools"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def mcp_url():
    saved = os.environ["VOICE_TOOLS_API_TOKENS"]
    os.environ["VOICE_TOOLS_API_TOKENS"] = f"{saved},mcp-client:{MCP_TOKEN}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_mcp_app(), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="mcp-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the MCP server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/mcp"
    server.should_exit = True
    thread.join(10)
    os.environ["VOICE_TOOLS_API_TOKENS"] = saved


@pytest.fixture
def client():
    """The REST API beside it (a test client kept out of ``with``: its Flask contexts would be
    pushed and popped in different contextvars contexts under the anyio runner)."""
    from app import create_app

    return create_app({"TESTING": True}).test_client()


@asynccontextmanager
async def connected(url: str, token: str = MCP_TOKEN, mode: str = "auto", timeout: float = 5.0):
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=timeout) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            yield client


async def answer(client: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool's structured result, checked to be a success that says the same as its JSON text."""
    result = await client.call_tool(name, arguments)
    assert not result.is_error, result.structured_content
    assert json.loads(result.content[0].text) == result.structured_content
    return result.structured_content


async def error(client: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool's error JSON, checked to be an is_error result whose text is that JSON."""
    result = await client.call_tool(name, arguments)
    assert result.is_error, result.structured_content
    assert json.loads(result.content[0].text) == result.structured_content
    assert set(result.structured_content) == {"error", "message", "details"}
    return result.structured_content


async def test_the_updating_email_walkthrough_entirely_over_mcp(mcp_url, worker, relay):
    urls = {"checkpoint": f"{relay.base}/tool-checkpoint", "completed": f"{relay.base}/tool-complete"}
    async with connected(mcp_url) as mcp:
        pending = await answer(mcp, "request_tool", {
            "session_id": "sess_mcp", "function": "send_email", "intent_id": "intent_1",
            "parameters": {"to": "john@example.com", "subject": "Meeting Tomorrow"}})
        tool_call_id = pending["tool_call_id"]
        assert pending["status"] == "PENDING" and pending["function_name"] == "send_email"
        assert "john@example.com" in pending["confirmation_message"]
        assert row(tool_call_id).caller == "mcp-client"

        modified = await answer(mcp, "modify_tool", {"tool_call_id": tool_call_id,
                                                     "parameters": {"to": "john.smith@example.com"}})
        assert modified["changes"] == [{"field": "to", "old": "john@example.com", "new": "john.smith@example.com"}]
        assert modified["status"] == "PENDING"

        prepared = await answer(mcp, "confirm_tool", {"tool_call_id": tool_call_id, "wait": 15,
                                                      "callback_urls": urls})
        assert prepared["status"] == "PREPARED" and prepared["current_step"] == "READY_TO_SEND", prepared
        assert set(prepared["actions_available"]) >= {"proceed", "cancel"}
        checkpoint = relay.wait_for(tool_call_id, "checkpoint")
        assert checkpoint["status"] == "PREPARED" and checkpoint["resume_webhook"].endswith(tool_call_id)

        done = await answer(mcp, "resume_tool", {"tool_call_id": tool_call_id, "action": "proceed", "wait": 15})
        assert done["status"] == "COMPLETED", done
        assert done["result"]["to"] == "john.smith@example.com"
        assert done["voice_response"] == "Email sent to john.smith@example.com."

    stored = row(tool_call_id)
    assert stored.status == "COMPLETED" and stored.result == done["result"]
    assert stored.parameters["to"] == "john.smith@example.com" and stored.intent_id == "intent_1"
    assert [h["field"] for h in stored.parameters_history] == ["to"]
    relay.wait_for(tool_call_id, "completed")
    assert [path for path, event in relay.events_at(tool_call_id)] == ["/tool-checkpoint", "/tool-complete"]
    assert [(d.event, d.url) for d in deliveries(tool_call_id) if d.url] == [
        ("checkpoint", urls["checkpoint"]), ("completed", urls["completed"])]


async def test_execute_then_cancel_at_the_checkpoint_over_mcp(mcp_url, worker):
    async with connected(mcp_url) as mcp:
        prepared = await answer(mcp, "execute_tool", {"session_id": "sess_mcp", "function": "send_email",
                                                      "parameters": GUIDE_EMAIL, "wait": 15})
        assert prepared["status"] == "PREPARED", prepared
        cancelled = await answer(mcp, "cancel_tool", {"tool_call_id": prepared["tool_call_id"],
                                                      "reason": "Changed my mind"})
        assert cancelled["status"] == "CANCELLED" and cancelled["voice_response"] == "Cancelled. The email was not sent."
        record = await answer(mcp, "get_status", {"tool_call_id": prepared["tool_call_id"]})
    assert record["status"] == "CANCELLED" and record["error_message"] == "Changed my mind"
    assert row(prepared["tool_call_id"]).status == "CANCELLED"
    acted = [(e["status"], e.get("by"), e.get("via")) for e in record["status_history"]]
    assert acted[0] == ("PENDING", "mcp-client", "MCP") and acted[1] == ("EXECUTING", "mcp-client", "MCP")
    assert acted[-1] == ("CANCELLED", "mcp-client", "MCP")
    assert ("PREPARED", None, None) in acted  # the chain's own checkpoint: nobody acted


async def test_bad_input_over_mcp_is_the_rest_apis_error_json_and_changes_nothing(mcp_url, client):
    created = client.post("/voice-tools/pending", headers=MCP_AUTH,
                          json={"session_id": "s", "function": "send_email", "parameters": GUIDE_EMAIL})
    tool_call_id = created.get_json()["tool_call_id"]
    assert client.delete(f"/voice-tools/cancel/{tool_call_id}", headers=MCP_AUTH).status_code == 200
    before = snapshot()
    async with connected(mcp_url) as mcp:
        unknown_tool = await error(mcp, "request_tool", {"session_id": "s", "function": "send_fax"})
        assert unknown_tool["error"] == "validation_error"
        assert "function" in unknown_tool["details"]["fields"]
        assert set(tools.names()) <= set(unknown_tool["details"]["known_tools"])
        assert unknown_tool == client.post("/voice-tools/pending", headers=MCP_AUTH,
                                           json={"session_id": "s", "function": "send_fax"}).get_json()

        bad_parameters = await error(mcp, "request_tool", {"session_id": "s", "function": "send_email",
                                                           "parameters": {"to": "not an address"}})
        assert "parameters" in bad_parameters["details"]["fields"], bad_parameters
        unknown_argument = await error(mcp, "confirm_tool", {"tool_call_id": tool_call_id, "when": "now"})
        assert unknown_argument["details"]["fields"] == {"when": ["Unknown field."]}
        missing_id = await error(mcp, "modify_tool", {"parameters": {"to": "a@example.com"}})
        assert list(missing_id["details"]["fields"]) == ["tool_call_id"]
        bad_wait = await error(mcp, "confirm_tool", {"tool_call_id": tool_call_id, "wait": 99})
        assert bad_wait == client.post(f"/voice-tools/confirm/{tool_call_id}?wait=99", headers=MCP_AUTH).get_json()
        assert list(bad_wait["details"]["fields"]) == ["wait"]

        not_found = await error(mcp, "modify_tool", {"tool_call_id": "tc_000000000000",
                                                     "parameters": {"to": "a@example.com"}})
        assert not_found["error"] == "not_found"
        assert not_found == client.patch("/voice-tools/modify/tc_000000000000", headers=MCP_AUTH,
                                         json={"parameters": {"to": "a@example.com"}}).get_json()

        wrong_status = await error(mcp, "modify_tool", {"tool_call_id": tool_call_id,
                                                        "parameters": {"to": "a@example.com"}})
        assert wrong_status["error"] == "invalid_status" and wrong_status["details"]["status"] == "CANCELLED"
        confirm_cancelled = await error(mcp, "confirm_tool", {"tool_call_id": tool_call_id})
        assert confirm_cancelled == client.post(f"/voice-tools/confirm/{tool_call_id}", headers=MCP_AUTH).get_json()
        assert confirm_cancelled["error"] == "already_terminal"
    assert snapshot() == before and call_count() == 1


async def test_a_rest_call_and_an_mcp_call_on_one_session_each_see_the_other(mcp_url, client):
    """One caller (the mcp-client token) on both faces sees the same calls; another caller
    (the tests' token) on the same session id sees none of them and its key is its own."""
    rest = client.post("/voice-tools/pending", headers=MCP_AUTH, json={
        "session_id": "sess_both", "function": "send_email", "parameters": GUIDE_EMAIL})
    assert rest.status_code == 201
    async with connected(mcp_url) as mcp:
        over_mcp = await answer(mcp, "request_tool", {
            "session_id": "sess_both", "function": "send_email", "idempotency_key": "key-1",
            "parameters": {"to": "jane@example.com", "subject": "Lunch"}})
        seen_by_mcp = await answer(mcp, "get_context", {"session_id": "sess_both"})
        # the same idempotency rule: a REST replay with the key gets the MCP call back
        replay = client.post("/voice-tools/pending", headers={**MCP_AUTH, "Idempotency-Key": "key-1"}, json={
            "session_id": "sess_both", "function": "send_email",
            "parameters": {"to": "jane@example.com", "subject": "Lunch"}})
        assert replay.status_code == 200 and replay.get_json()["tool_call_id"] == over_mcp["tool_call_id"]
        first = await mcp.call_tool("request_tool", {  # and the REST status rides along in _meta
            "session_id": "sess_both", "function": "send_email", "idempotency_key": "key-1",
            "parameters": {"to": "jane@example.com", "subject": "Lunch"}})
        assert first.structured_content["tool_call_id"] == over_mcp["tool_call_id"]
        assert first.meta["voice-tools/http_status"] == 200
        again = await client_answer_equal(mcp, client, over_mcp["tool_call_id"])
    seen_by_rest = client.get("/voice-tools/context/sess_both", headers=MCP_AUTH).get_json()
    ids = {rest.get_json()["tool_call_id"], over_mcp["tool_call_id"]}
    assert {c["tool_call_id"] for c in seen_by_mcp["pending"]} == ids
    assert seen_by_mcp == seen_by_rest
    assert again["caller"] == "mcp-client" and row(rest.get_json()["tool_call_id"]).caller == "mcp-client"
    # another caller: the session is empty to it, the MCP call unknown, and key-1 makes it a call of its own
    other = client.get("/voice-tools/context/sess_both", headers=AUTH).get_json()
    assert other["pending"] == [] and other["recent"] == []
    hidden = client.get(f"/voice-tools/status/{over_mcp['tool_call_id']}", headers=AUTH)
    assert hidden.status_code == 404 and hidden.get_json()["error"] == "not_found"
    own = client.post("/voice-tools/pending", headers={**AUTH, "Idempotency-Key": "key-1"}, json={
        "session_id": "sess_both", "function": "send_email",
        "parameters": {"to": "jane@example.com", "subject": "Lunch"}})
    assert own.status_code == 201 and own.get_json()["tool_call_id"] not in ids
    assert row(own.get_json()["tool_call_id"]).caller == "tests" and call_count() == 3


async def test_over_mcp_another_callers_call_and_context_are_unknown_and_an_admin_sees_them(mcp_url, client,
                                                                                              monkeypatch):
    """Callers fenced on the MCP face: the tests' token's call is not_found to mcp-client, as an
    unknown id, and nothing of it changes; an ``:admin`` token over MCP sees and cancels it."""
    from models import db, session_context

    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"{os.environ['VOICE_TOOLS_API_TOKENS']},ops:ops-mcp:admin")
    theirs = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_fenced", "function": "send_email", "parameters": GUIDE_EMAIL}).get_json()["tool_call_id"]
    with db.session() as s:
        session_context.put_context(s, "sess_fenced", "last_query_results", {"summary": "theirs"}, 3600, caller="tests")
    before = snapshot()
    by_id = [("get_status", {}), ("modify_tool", {"parameters": {"to": "a@example.com"}}), ("confirm_tool", {}),
             ("resume_tool", {"action": "cancel"}), ("cancel_tool", {})]
    async with connected(mcp_url) as mcp:
        for name, arguments in by_id:
            foreign = await error(mcp, name, {"tool_call_id": theirs, **arguments})
            unknown = await error(mcp, name, {"tool_call_id": "tc_000000000000", **arguments})
            assert foreign == {"error": "not_found", "message": f"No tool call {theirs}.",
                               "details": {"tool_call_id": theirs}}, name
            assert unknown["error"] == "not_found", name
        assert await answer(mcp, "get_context", {"session_id": "sess_fenced"}) == {
            "session_id": "sess_fenced", "pending": [], "recent": []}
        hidden = await error(mcp, "get_session_context", {"session_id": "sess_fenced",
                                                          "context_key": "last_query_results"})
        assert hidden["error"] == "not_found"
        taken = await error(mcp, "request_tool", {"session_id": "sess_fenced", "function": "send_email",
                                                  "tool_call_id": theirs, "parameters": GUIDE_EMAIL})
        assert taken == {"error": "idempotency_conflict", "details": {"tool_call_id": theirs},
                         "message": f"The tool_call_id '{theirs}' is already in use; give another one (or none)."}
    assert snapshot() == before
    async with connected(mcp_url, token="ops-mcp") as ops:
        assert (await answer(ops, "get_status", {"tool_call_id": theirs}))["caller"] == "tests"
        seen = await answer(ops, "get_context", {"session_id": "sess_fenced"})
        assert [c["tool_call_id"] for c in seen["pending"]] == [theirs]
        assert (await answer(ops, "cancel_tool", {"tool_call_id": theirs}))["status"] == "CANCELLED"
    assert row(theirs).status == "CANCELLED"


async def client_answer_equal(mcp: Client, client, tool_call_id: str) -> dict[str, Any]:
    """get_status over MCP answers exactly GET /voice-tools/status/{id}."""
    record = await answer(mcp, "get_status", {"tool_call_id": tool_call_id})
    assert record == client.get(f"/voice-tools/status/{tool_call_id}", headers=MCP_AUTH).get_json()
    return record


async def test_list_tools_lists_every_registry_tool_with_an_object_input_schema(mcp_url):
    async with connected(mcp_url) as mcp:
        faces = {tool.name: tool for tool in (await mcp.list_tools()).tools}
        listed = await answer(mcp, "list_tools", {})
        assert (await error(mcp, "list_tools", {"format": "chat"}))["details"]["fields"] == {"format": ["Unknown field."]}
    assert set(faces) == FACES
    assert all(face.input_schema["type"] == "object" for face in faces.values())
    assert faces["resume_tool"].input_schema["properties"]["action"]["enum"] == ["proceed", "cancel"]
    assert set(faces["confirm_tool"].input_schema["required"]) == {"tool_call_id"}
    assert [t["name"] for t in listed["tools"]] == tools.names()
    for tool in listed["tools"]:
        assert tool["inputSchema"]["type"] == "object" and tool["description"]
        assert tool["inputSchema"] == toolspec.parameters_schema(tools.TOOLS[tool["name"]])


async def test_without_a_known_token_the_mcp_endpoint_refuses_at_the_http_level(mcp_url):
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with httpx2.AsyncClient() as http:
        missing = await http.post(mcp_url, json=initialize)
        wrong = await http.post(mcp_url, json=initialize, headers={"Authorization": "Bearer nope"})
        health = await http.get(mcp_url.removesuffix("/mcp") + "/healthz")
    assert missing.status_code == 401 and missing.json()["error"] == "unauthorized"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert wrong.status_code == 401 and wrong.json()["message"] == "Unknown API token."
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    with pytest.raises(BaseExceptionGroup) as refused:  # the SDK's client gives up on the 401
        async with connected(mcp_url, token="nope") as mcp:
            await mcp.list_tools()
    assert refused.group_contains(MCPError)
    # the REST API's token works here too, and so does a client of the older initialize handshake
    async with connected(mcp_url, token=API_TOKEN, mode="legacy") as mcp:
        assert {tool.name for tool in (await mcp.list_tools()).tools} == FACES
        assert (await error(mcp, "get_status", {"tool_call_id": "tc_000000000000"}))["error"] == "not_found"


async def test_a_server_reached_with_no_identified_caller_refuses_every_tool_and_runs_nothing(client):
    """Fail closed: the MCP server without its HTTP door (here the SDK's own client, in process: no request,
    so no token) answers every tool 401, never the operator's unscoped door."""
    from app.mcp_server import create_mcp_server

    created = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_nobody", "function": "send_email", "parameters": GUIDE_EMAIL})
    tool_call_id = created.get_json()["tool_call_id"]
    before = snapshot()
    async with Client(create_mcp_server()) as mcp:
        assert {tool.name for tool in (await mcp.list_tools()).tools} == FACES  # what exists is no secret
        for name, arguments in [("get_status", {"tool_call_id": tool_call_id}),
                                ("get_context", {"session_id": "sess_nobody"}),
                                ("cancel_tool", {"tool_call_id": tool_call_id}),
                                ("request_tool", {"session_id": "sess_nobody", "function": "send_email",
                                                  "parameters": GUIDE_EMAIL}),
                                ("list_tools", {})]:
            result = await mcp.call_tool(name, arguments)
            assert result.is_error and result.structured_content["error"] == "unauthorized", (name, result)
            assert result.meta["voice-tools/http_status"] == 401
    assert snapshot() == before


async def test_a_callback_url_with_a_line_break_or_a_space_is_refused_over_mcp_as_over_rest(mcp_url, client):
    before = snapshot()
    url = "http://127.0.0.1:9/cb\r\nX-Injected: yes"
    async with connected(mcp_url) as mcp:
        for name in ("request_tool", "execute_tool"):
            refused = await error(mcp, name, {"session_id": "s", "function": "send_email", "parameters": GUIDE_EMAIL,
                                              "callback_urls": {"progress": "http://127.0.0.1:9/a b"},
                                              "callback_url": url})
            assert refused["error"] == "validation_error"
            assert {"callback_url", "callback_urls"} <= set(refused["details"]["fields"]), refused
            assert refused == client.post("/voice-tools/pending", headers=MCP_AUTH, json={
                "session_id": "s", "function": "send_email", "parameters": GUIDE_EMAIL,
                "callback_urls": {"progress": "http://127.0.0.1:9/a b"}, "callback_url": url}).get_json()
    assert snapshot() == before


async def test_del_and_c1_controls_are_refused_over_mcp_as_over_rest(mcp_url, client):
    """DEL (U+007F) and the C1 controls (U+0080-U+009F) are control characters: 422 on both doors."""
    before = snapshot()
    async with connected(mcp_url) as mcp:
        for text in ("a\x7f", "a\x85", "a\x9b31m"):
            arguments = {"session_id": "s", "function": "send_email", "parameters": {**GUIDE_EMAIL, "subject": text}}
            for name in ("request_tool", "execute_tool"):
                refused = await error(mcp, name, arguments)
                assert refused["error"] == "validation_error" and "parameters" in refused["details"]["fields"], refused
            assert refused == client.post("/voice-tools/pending", headers=MCP_AUTH, json=arguments).get_json()
    assert snapshot() == before


async def test_a_key_given_twice_in_an_mcp_request_is_400_naming_it(mcp_url):
    """The JSON-RPC message is read once at the door with every key kept: a key given twice, in the
    envelope or in the arguments, is refused before the SDK (which keeps the last) reads it."""
    before = snapshot()
    headers = {**MCP_AUTH, "Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    twice_in_arguments = ('{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "request_tool", '
                          '"arguments": {"session_id": "a", "session_id": "b", "function": "send_email", '
                          '"parameters": {"to": "john@example.com", "subject": "Hi"}}}}')
    twice_in_envelope = ('{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "get_status", '
                         '"name": "request_tool", "arguments": {"session_id": "a", "function": "send_email", '
                         '"parameters": {"to": "john@example.com", "subject": "Hi"}}}}')
    async with httpx2.AsyncClient() as http:
        for text, key in ((twice_in_arguments, "session_id"), (twice_in_envelope, "name")):
            refused = await http.post(mcp_url, content=text, headers=headers)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"] == "bad_json" and refused.json()["details"] == {"key": key}
        once = await http.post(mcp_url, headers=headers, content='{"jsonrpc": "2.0", "id": 2, "method": "tools/list"}')
    assert once.status_code == 200 and {t["name"] for t in once.json()["result"]["tools"]} == FACES
    assert snapshot() == before


async def test_a_token_named_past_100_characters_is_refused_clearly_over_mcp_too(mcp_url, monkeypatch):
    """On the MCP face, the same 401 as REST, not a database error later."""
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"{os.environ['VOICE_TOOLS_API_TOKENS']},{'n' * 101}:long-token")
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with httpx2.AsyncClient() as http:
        refused = await http.post(mcp_url, json=listing, headers={"Authorization": "Bearer long-token"})
    assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    assert "longer than 100 characters" in refused.json()["message"]


async def test_an_mcp_client_follows_the_checkpoint_on_the_event_stream_and_cancels_there(mcp_url, api_url, worker):
    """No callback endpoint at all: the checkpoint is read from GET /voice-tools/events, the cancel said over MCP."""
    import asyncio

    from support.sse_client import Stream

    stream = Stream(f"{api_url}/voice-tools/events/sess_mcp_sse", MCP_AUTH)
    async with connected(mcp_url) as mcp:
        pending = await answer(mcp, "request_tool", {"session_id": "sess_mcp_sse", "function": "send_email",
                                                     "parameters": GUIDE_EMAIL})
        tool_call_id = pending["tool_call_id"]
        started = await answer(mcp, "confirm_tool", {"tool_call_id": tool_call_id})
        assert started["status"] == "EXECUTING"
        events = [await asyncio.to_thread(stream.next_event) for _ in range(2)]
        assert [e["event"] for _, e in events] == ["progress", "checkpoint"]
        assert events[1][1]["tool_call_id"] == tool_call_id and events[1][1]["checkpoint"] == "READY_TO_SEND"
        cancelled = await answer(mcp, "resume_tool", {"tool_call_id": tool_call_id, "action": "cancel"})
        assert cancelled["status"] == "CANCELLED"
        last = await asyncio.to_thread(stream.next_event)
    stream.close()
    assert last[1]["event"] == "cancelled" and last[1]["seq"] == 3
    assert row(tool_call_id).status == "CANCELLED" and row(tool_call_id).committed_at is None


async def test_an_mcp_client_searches_then_emails_the_results(mcp_url, worker):
    from voice_tools_backends import documents

    documents.load_demo()
    async with connected(mcp_url) as mcp:
        searched = await answer(mcp, "execute_tool", {
            "session_id": "sess_mcp_docs", "function": "query_vector_db", "wait": 15,
            "parameters": {"user_query": "Q3 sales northwest"}})
        assert searched["status"] == "COMPLETED", searched
        top = searched["result"]["documents"][0]["title"]
        kept = await answer(mcp, "get_session_context", {"session_id": "sess_mcp_docs",
                                                         "context_key": "last_query_results"})
        assert kept["context"]["documents"][0]["title"] == top
        pending = await answer(mcp, "request_tool", {
            "session_id": "sess_mcp_docs", "function": "send_email",
            "parameters": {"to": "john.smith@example.com", "subject": "Q3", "reference_context": "last_query_results"}})
        prepared = await answer(mcp, "confirm_tool", {"tool_call_id": pending["tool_call_id"], "wait": 15})
        assert prepared["status"] == "PREPARED"
        done = await answer(mcp, "resume_tool", {"tool_call_id": pending["tool_call_id"], "action": "proceed",
                                                 "wait": 15})
        assert done["status"] == "COMPLETED" and done["voice_response"] == "Email sent to john.smith@example.com."
        context = await answer(mcp, "get_context", {"session_id": "sess_mcp_docs"})
    assert [c["function_name"] for c in context["recent"]] == ["send_email", "query_vector_db"]
    from sqlalchemy import select

    from models import db
    from models.email import EmailOutbox

    with db.session() as s:
        body = s.scalars(select(EmailOutbox.body).where(EmailOutbox.tool_call_id == pending["tool_call_id"])).one()
    assert top in body


@pytest.mark.slow
def test_the_lazy_command_listens_at_once_and_loads_the_face_at_its_first_connection():
    """``voice-tools mcp --lazy``: the port listens before any of the face's
    libraries is loaded (pydantic's compiled core is not mapped into the process), and the first
    connection, kept in the listen backlog while they load, is answered by the face."""
    import psutil
    import requests

    from support.procs import ROOT, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voice_tools", "mcp", "--lazy", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def loaded() -> bool:
        return any("pydantic_core" in mapped.path for mapped in psutil.Process(proc.pid).memory_maps())

    try:
        said = json.loads(proc.stdout.readline())
        assert said["message"] == f"MCP face on http://127.0.0.1:{port}/mcp, loaded at its first connection", said
        listening = {conn.laddr.port for conn in psutil.Process(proc.pid).net_connections(kind="inet")
                     if conn.status == psutil.CONN_LISTEN}
        assert listening == {port}
        assert not loaded()
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=60).json() == {"status": "ok"}
        assert loaded()
        hello = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        refused = requests.post(f"http://127.0.0.1:{port}/mcp", json=hello, timeout=10,
                                headers={"Accept": "application/json, text/event-stream"})
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    finally:
        proc.terminate()  # uvicorn stops gracefully, then ends by the signal it caught
        proc.wait(timeout=30)
        rest = proc.stdout.read()
        assert "Application shutdown complete." in rest and "Traceback" not in rest, rest


async def test_the_local_web_line_serves_the_mcp_face_from_its_workers_loaded_at_the_first_connection(tmp_path):
    """``Procfile.local``'s web line (``VOICE_TOOLS_MCP_BIND``): gunicorn's master listens on ``MCP_PORT``
    before it forks, and its workers (two here, on that one socket) serve the face from a thread of
    their own, loaded at the first connection (pydantic's compiled core is not mapped before). Over MCP a
    call the REST API recorded reads as over REST; SIGTERM stops the face with the worker, cleanly."""
    import psutil
    import requests

    from support.procs import ROOT, free_port, stop_process

    web = next(line.split(":", 1)[1].strip() for line in (ROOT / "Procfile.local").read_text().splitlines()
               if line.startswith("web:"))
    port, mcp_port = free_port(), free_port()
    metrics = tmp_path / "prometheus"
    metrics.mkdir()
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), "MCP_PORT": str(mcp_port), "WEB_CONCURRENCY": "2",
           "PROMETHEUS_MULTIPROC_DIR": str(metrics), "PYTHONPATH": str(ROOT),
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"}
    log_path = tmp_path / "web.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["sh", "-c", f"exec {web}"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)

    def loaded(pid: int) -> bool:
        return any("pydantic_core" in mapped.path for mapped in psutil.Process(pid).memory_maps())

    def listening(pid: int) -> set[int]:
        return {conn.laddr.port for conn in psutil.Process(pid).net_connections(kind="inet")
                if conn.status == psutil.CONN_LISTEN}

    try:
        deadline = time.monotonic() + 60
        while len(psutil.Process(proc.pid).children()) < 2 or not _answers(f"http://127.0.0.1:{port}/healthz"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.2)
        master, workers = proc.pid, [child.pid for child in psutil.Process(proc.pid).children()]
        assert listening(master) == {port, mcp_port}  # bound once, before the fork
        assert not any(loaded(pid) for pid in [master, *workers]), "loaded before it was used"

        created = requests.post(f"http://127.0.0.1:{port}/voice-tools/pending", headers=AUTH, timeout=30, json={
            "session_id": "sess_mcp_in_web", "function": "send_email",
            "parameters": {"to": "john@example.com", "subject": "Hi"}})
        assert created.status_code == 201, created.text
        tool_call_id = created.json()["tool_call_id"]
        # the first connection waits in the listen backlog while the worker imports the face: seconds, more
        # than httpx's 5 s on a loaded machine
        async with connected(f"http://127.0.0.1:{mcp_port}/mcp", token=API_TOKEN, timeout=60) as mcp:
            assert {tool.name for tool in (await mcp.list_tools()).tools} == FACES
            status = await answer(mcp, "get_status", {"tool_call_id": tool_call_id})
        rest = requests.get(f"http://127.0.0.1:{port}/voice-tools/status/{tool_call_id}", headers=AUTH, timeout=30)
        assert status == rest.json() and status["status"] == "PENDING"
        asked = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                 "params": {"name": "get_status", "arguments": {"tool_call_id": tool_call_id}}}
        for headers in ({}, {"Authorization": "Bearer nope"}):  # no caller identified: refused, never unscoped
            refused = requests.post(f"http://127.0.0.1:{mcp_port}/mcp", json=asked, timeout=30,
                                    headers={**headers, "Accept": "application/json, text/event-stream"})
            assert refused.status_code == 401 and refused.json()["error"] == "unauthorized", refused.text
        assert any(loaded(pid) for pid in workers) and not loaded(master)  # a worker loaded it, the master never
        assert {pid for pid in workers if mcp_port in listening(pid)} == set(workers)  # the socket, inherited
    finally:
        stop_process(proc)
    said = log_path.read_text(errors="replace")
    assert "first connection: loading the MCP face" in said and "Application shutdown complete." in said, said
    assert "Traceback" not in said, said


def _answers(url: str) -> bool:
    import requests

    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


async def test_an_mcp_wait_takes_none_of_the_web_threads_of_the_process_serving_it(mcp_url, monkeypatch):
    """Served by the API's gunicorn worker (``Procfile.local``), the MCP face waits on its own threads
    (``MCP_THREADS``): a ``wait`` over MCP counts against its caller's share, not against the worker's
    web threads kept from long-held requests. Here that process guard is full (one slot, taken by a
    REST wait): the MCP confirm still gets the operation's own answer (409, the call is cancelled), not
    the server's 429."""
    from app import shares

    async with connected(mcp_url) as mcp:
        created = await answer(mcp, "request_tool", {"session_id": "mcp_threads", "function": "send_email",
                                                     "parameters": GUIDE_EMAIL})
        await answer(mcp, "cancel_tool", {"tool_call_id": created["tool_call_id"]})
        shares.serve_with_threads(3)  # 3 web threads, 2 kept: one long-held request at once
        held = shares.take_slot("a-rest-caller", "wait")
        try:
            assert held.in_process
            refused = await error(mcp, "confirm_tool", {"tool_call_id": created["tool_call_id"], "wait": 1})
        finally:
            held.release()
            shares.serve_with_threads(None)
    assert refused["error"] != "too_many_open", refused
    assert refused["details"].get("status") == "CANCELLED" or "cancel" in refused["message"].lower(), refused


async def test_mcp_shares_the_callers_limits_a_wait_past_its_open_share_and_a_rate_past_its_own(mcp_url, api_url,
                                                                                            monkeypatch):
    """The fair shares of the REST API hold on the MCP face too (docs/relay-guide.md, "Limits and small
    rules"): a tool's ``wait`` counts against the caller's open share (an event stream open on REST
    fills it here: the wait is refused, 429, and nothing done), and past its rate the HTTP request is a JSON 429 with
    ``Retry-After``. A caller of
    its own: a stream another test dropped holds its slot until the server writes to it again."""
    import asyncio
    import uuid

    import requests

    name, token = f"mcp-share-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    auth = {"Authorization": f"Bearer {token}"}
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"{os.environ['VOICE_TOOLS_API_TOKENS']},{name}:{token}")
    monkeypatch.setenv("VOICE_TOOLS_CALLER_LIMITS", f"{name}::1")
    async with connected(mcp_url, token=token) as mcp:
        created = await answer(mcp, "request_tool", {"session_id": "mcp_share", "function": "send_email",
                                                     "parameters": GUIDE_EMAIL})
        stream = await asyncio.to_thread(requests.get, f"{api_url}/voice-tools/events/mcp_share", headers=auth,
                                         stream=True, timeout=(5, 20))
        try:
            assert stream.status_code == 200
            started = time.monotonic()
            refused = await mcp.call_tool("confirm_tool", {"tool_call_id": created["tool_call_id"], "wait": 5})
            assert time.monotonic() - started < 2  # answered at once
            assert refused.is_error and refused.meta["voice-tools/http_status"] == 429
            assert refused.structured_content["error"] == "too_many_open"
            assert refused.structured_content["details"]["kind"] == "wait"
            status = await answer(mcp, "get_status", {"tool_call_id": created["tool_call_id"]})
            assert status["status"] == "PENDING"  # the refused confirm did nothing
        finally:
            stream.close()
    monkeypatch.setenv("VOICE_TOOLS_CALLER_LIMITS", f"{name}:2/minute:")
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with httpx2.AsyncClient(headers={**auth, "Accept": "application/json, text/event-stream"}) as http:
        codes = [(await http.post(mcp_url, json=listing)) for _ in range(3)]
    assert [c.status_code != 429 for c in codes] == [True, True, False], [c.status_code for c in codes]
    assert codes[2].json()["error"] == "rate_limited" and int(codes[2].headers["retry-after"]) >= 1


async def test_mcp_waits_hold_no_thread_of_the_face(mcp_url):
    """A ``wait`` is awaited on the face's event loop, not in one of its ``MCP_THREADS`` (16) worker threads:
    20 waits held at once on calls that do not move, and another tool is still answered at once."""
    import asyncio
    import uuid

    from models import db, lifecycle
    from tests.helpers import make_call

    replays = []
    for _ in range(20):
        key = uuid.uuid4().hex
        call = make_call(caller="mcp-client", idempotency_key=key, request_kind="execute", session_id="mcp_held")
        with db.session() as s:
            lifecycle.confirm(s, call.tool_call_id)  # EXECUTING, and nothing moves it on
        replays.append({"session_id": "mcp_held", "function": "send_email", "parameters": call.parameters,
                        "idempotency_key": key, "wait": 3.5})  # within the client's 5 s read timeout
    async with connected(mcp_url) as mcp:
        held = [asyncio.ensure_future(answer(mcp, "execute_tool", replay)) for replay in replays]
        await asyncio.sleep(1.0)  # every wait arrived and is held
        started = time.monotonic()
        status = await answer(mcp, "get_status", {"tool_call_id": call.tool_call_id})
        took = time.monotonic() - started
        records = await asyncio.gather(*held)
    assert status["status"] == "EXECUTING"
    assert took < 2.0, took  # not queued behind the waits
    assert [r["status"] for r in records] == ["EXECUTING"] * 20  # each wait ran its course: the record at its end
