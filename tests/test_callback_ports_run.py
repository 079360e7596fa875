"""Under ``voice-tools run`` (honcho gives each process its own ``PORT``), a callback_url on a port
of this system is refused by every face: the API's port given over MCP, the workers' metrics port
given over REST (docs/relay-guide.md, Callbacks, "Delivery: what is refused and why").

One real run for the module, as tests/test_run_command.py starts it.
"""
from __future__ import annotations

import asyncio
import json

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from support.procs import wait_none_running
from tests.test_run_command import TOKEN, System

pytestmark = pytest.mark.slow  # a real voice-tools run


@pytest.fixture(scope="module")
def system():
    started = System()
    try:
        started.wait_healthy()
        started.wait_listening(started.mcp_port)
        yield started
    finally:
        if started.proc.poll() is None:
            started.stop()
        for proc in wait_none_running(started.data_dir):  # only ours: they carry this test's data dir
            proc.kill()
        started.remove()


async def _request_tool(mcp_url: str, arguments: dict) -> tuple[bool, dict]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        async with Client(streamable_http_client(mcp_url, http_client=http)) as client:
            result = await client.call_tool("request_tool", arguments)
            return result.is_error, json.loads(result.content[0].text)


def test_the_apis_port_is_refused_as_a_callback_given_over_mcp(system):
    own_api = f"http://127.0.0.1:{system.port}/voice-tools/pending"
    is_error, body = asyncio.run(_request_tool(f"http://127.0.0.1:{system.mcp_port}/mcp", {
        "session_id": "ports", "function": "send_email", "callback_url": own_api,
        "parameters": {"to": "john@example.com", "subject": "Ports"}}))
    assert is_error, body
    assert body["error"] == "validation_error"
    assert f"port {system.port} on 127.0.0.1 is this system's own API port" in json.dumps(body), body


@pytest.mark.parametrize("face, port", [("worker metrics", "metrics_port"), ("MCP", "mcp_port"),
                                         ("Flower", "flower_port")])
def test_every_other_port_of_the_run_is_refused_over_rest(system, face, port):
    own = getattr(system, port)
    created = system.api("POST", "/voice-tools/pending", json={
        "session_id": "ports", "function": "send_email", "callback_url": f"http://127.0.0.1:{own}/cb",
        "parameters": {"to": "john@example.com", "subject": "Ports"}})
    assert created.status_code == 422, created.text
    assert f"port {own} on 127.0.0.1 is this system's own {face} port" in created.text
