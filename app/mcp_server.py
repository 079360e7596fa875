"""The MCP face (docs/relay-guide.md, MCP): the REST API's operations as MCP tools.

An MCP client (an assistant runtime that speaks the Model Context Protocol) drives
tool calls here instead of over REST: ``request_tool`` -> ``modify_tool`` ->
``confirm_tool`` (``wait``) -> ``resume_tool`` (``action``, ``wait``), ``cancel_tool``,
``execute_tool``, ``get_status``, ``get_context``, ``get_session_context`` and
``list_tools`` (the registry's tools with their JSON Schemas).

The server is the MCP SDK's low-level ``Server`` with two handlers, ``tools/list`` and
``tools/call``: it advertises tools and nothing else, and reports the package's version. The
listed ``inputSchema``s are JSON Schema documents given as they are, and ``tools/call`` hands the
raw arguments on, so that our request schemas alone judge them (no model of the SDK's between).

Each MCP tool is one line over the operation of ``tasks.calls.operations`` that the REST view
of the same route calls: its arguments are the REST call's path arguments, query and
body fields side by side (``tool_call_id``, ``wait``, ``session_id``, ``function``,
``parameters``, ...), split back into those three parts and validated by the same
request schemas; its result is the REST answer's JSON, as structured content and as
JSON text. An error is the REST error's ``{error, message, details}`` (from
``tasks.calls.errors.api_error``) in a result with ``isError: true``, whatever the HTTP status
would have been (404, 409, 422, 503 ...); a tool name the server does not have is a
``not_found`` error result naming the known tools. The argument JSON Schemas (``inputSchema``,
JSON Schema 2020-12) are generated from those same marshmallow schemas.

Every request needs ``Authorization: Bearer <token>`` of ``VOICE_TOOLS_API_TOKENS``
(``tasks.calls.callers``' token lookup; the token's name is the call's ``caller``), refused
with a JSON 401 at the HTTP level otherwise; a tool call that reaches the server with no caller
identified all the same (the server on another transport) is a 401 error result, never run
unscoped. A JSON body that gives a key twice is a 400 ``bad_json`` naming it. The transport is
streamable HTTP at ``/mcp``, stateless with JSON responses (any process can answer any request).

Run it with ``python -m app.mcp_server`` (``--host``/``--port``, defaults ``HOST`` or
127.0.0.1 and ``MCP_PORT`` or 8001), or ``uvicorn --factory app.mcp_server:create_mcp_app``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Mapping

import anyio
import anyio.to_thread
from marshmallow import Schema
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import (CallToolRequestParams, CallToolResult, ListToolsResult, PaginatedRequestParams, TextContent,
                       Tool, ToolAnnotations)
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import http_framing, json_depth, json_keys, shares, stream_loop
from app.limits import MAX_BODY_BYTES
from models import listen, logs, release, schema
from tasks import tools
from tasks.calls import callers, errors, operations, schemas, toolspec
from tasks.calls.callers import Caller
from tasks.calls.errors import ApiError
from app import server_spans as tracing

log = logging.getLogger(__name__)

MCP_PATH = "/mcp"
HEALTH_PATH = "/healthz"  # the one path open without a token
SERVER_NAME = "voice-tools"
INSTRUCTIONS = (
    "Runs a voice assistant's tool calls. Call list_tools for the tools and their parameters. "
    "request_tool records a call as PENDING and answers the sentence to read back; modify_tool changes it; "
    "confirm_tool starts it (wait up to 30 s for the answer); a write stops at a checkpoint (PREPARED): "
    "resume_tool with action proceed or cancel. Speak voice_response when status is COMPLETED or FAILED."
)
NO_ARGUMENTS: type[Schema] = schemas.Strict  # no fields: any argument is an unknown field (422)

PATH_DESCRIPTIONS = {"tool_call_id": "The call's id (request_tool answers it)", "session_id": "The relay's session"}

Arguments = dict[str, Any]
Answer = operations.Answer


# -- the MCP tools: each one line over tasks.calls.operations ------------------------------------------

@dataclass(frozen=True)
class Face:
    """One MCP tool: which REST parts its arguments come from, and the operation it runs."""

    name: str
    description: str
    run: Callable[..., Any]  # (path, query, body, caller[, hand_over: a face with a wait]) -> its answer
    path: type[Schema] | None = None  # arguments that are the REST path's
    query: type[Schema] | None = None  # arguments that are the REST query's
    body: type[Schema] | None = None  # the rest: the REST body
    read_only: bool = False

    def split(self, arguments: Arguments) -> tuple[Arguments, Arguments, Arguments]:
        """``(path, query, body)``: the path and query schemas' fields, then everything else."""
        path_names = set(self.path._declared_fields) if self.path else set()
        query_names = set(self.query._declared_fields) if self.query else set()
        path = {k: v for k, v in arguments.items() if k in path_names}
        query = {k: v for k, v in arguments.items() if k in query_names}
        body = {k: v for k, v in arguments.items() if k not in path_names | query_names}
        if self.path is not None:
            path = schemas.load(self.path, path)  # a missing path argument is 422 naming it
        if self.body is NO_ARGUMENTS:  # an operation without a body: what is left is unknown (422)
            schemas.load(NO_ARGUMENTS, body)
        return path, query, body

    def input_schema(self) -> dict[str, Any]:
        """The JSON Schema of the arguments, from the same request schemas (unknown fields are refused)."""
        merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
        for part in (self.path, self.query, self.body):
            if part is None:
                continue
            converted = _json_schema(part)
            merged["properties"].update(converted.get("properties", {}))
            merged["required"].extend(converted.get("required", []))
        if not merged["required"]:
            del merged["required"]
        for name, description in PATH_DESCRIPTIONS.items():
            if name in merged["properties"]:
                merged["properties"][name].setdefault("description", description)
        merged["additionalProperties"] = False
        return merged


def _json_schema(schema: type[Schema]) -> dict[str, Any]:
    return toolspec.json_schema(schema)


def tool_schemas(_: Arguments, query: Arguments, body: Arguments, caller: Caller) -> Answer:
    """list_tools: every tool of the registry as ``{name, description, inputSchema}``."""
    found = [{"name": tool.name, "description": tool.description, "inputSchema": toolspec.parameters_schema(tool)}
             for tool in (tools.TOOLS[name] for name in tools.names())]
    return {"tools": found}, 200


FACES = (
    Face("request_tool",
         "Record a tool call as PENDING (nothing runs yet); answers the confirmation sentence to read back. "
         "= POST /voice-tools/pending",
         lambda path, query, body, caller: operations.pending(body, caller), body=schemas.PendingRequest),
    Face("modify_tool",
         "Change parameters of a PENDING call (a null removes an optional field). = PATCH /voice-tools/modify/{id}",
         lambda path, query, body, caller: operations.modify(path["tool_call_id"], body, caller),
         path=schemas.ToolCallPath, body=schemas.ModifyRequest),
    Face("confirm_tool",
         "The user said yes: a PENDING call starts. With wait, answers the call's record once it is PREPARED "
         "(a write's checkpoint) or finished. = POST /voice-tools/confirm/{id}?wait=",
         lambda path, query, body, caller, hand_over=None: operations.confirm(path["tool_call_id"], body, query,
                                                                             caller, hand_over),
         path=schemas.ToolCallPath, query=schemas.WaitQuery, body=schemas.ConfirmRequest),
    Face("resume_tool",
         "At the checkpoint (PREPARED): action proceed (the point of no return) or cancel. With wait, answers "
         "the record once finished. = POST /voice-tools/resume/{id}?wait=",
         lambda path, query, body, caller, hand_over=None: operations.resume(path["tool_call_id"], body, query,
                                                                            caller, hand_over),
         path=schemas.ToolCallPath, query=schemas.WaitQuery, body=schemas.ResumeRequest),
    Face("cancel_tool",
         "Cancel a call before its point of no return. = DELETE /voice-tools/cancel/{id}",
         lambda path, query, body, caller: operations.cancel(path["tool_call_id"], body, {}, caller),
         path=schemas.ToolCallPath, body=schemas.CancelRequest),
    Face("execute_tool",
         "Record and start at once a call the user already confirmed (arguments as request_tool, plus wait). "
         "= POST /voice-tools/execute?wait=",
         lambda path, query, body, caller, hand_over=None: operations.execute(body, query, caller, None, hand_over),
         query=schemas.WaitQuery, body=schemas.PendingRequest),
    Face("get_status",
         "The whole record of a call. = GET /voice-tools/status/{id}",
         lambda path, query, body, caller: operations.status(path["tool_call_id"], caller),
         path=schemas.ToolCallPath, body=NO_ARGUMENTS, read_only=True),
    Face("get_context",
         "A session's open calls and its recent finished ones (newest first). = GET /voice-tools/context/{session_id}",
         lambda path, query, body, caller: operations.context(path["session_id"], query, caller),
         path=schemas.SessionPath, query=schemas.ContextQuery, body=NO_ARGUMENTS, read_only=True),
    Face("get_session_context",
         "A stored session context value (e.g. search results an email refers to). "
         "= GET /voice-tools/session-context",
         lambda path, query, body, caller: operations.session_context(query, caller),
         query=schemas.SessionContextQuery, body=NO_ARGUMENTS, read_only=True),
    Face("list_tools",
         "Every tool this service runs, with its parameters' JSON Schema as inputSchema.",
         tool_schemas, body=NO_ARGUMENTS, read_only=True),
)


# -- running one: the arguments as given, the answer or the error as JSON ------------------

def _bad_arguments(arguments: Arguments) -> ApiError | None:
    """The REST body's JSON rules (docs/relay-guide.md, Errors) for arguments: finite numbers, bounded nesting."""
    if json_depth.depth(arguments) > json_depth.MAX_DEPTH:
        return ApiError(400, "bad_json", f"The arguments nest deeper than {json_depth.MAX_DEPTH} levels.",
                        {"max_depth": json_depth.MAX_DEPTH})
    stack: list[Any] = [arguments]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return ApiError(400, "bad_json", "The arguments hold a number out of range.", {"reason": repr(item)})
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _result(answer: dict[str, Any], status: int, is_error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(answer, ensure_ascii=False))],
                          structured_content=answer, is_error=is_error,
                          _meta={"voice-tools/http_status": status})


@dataclass
class Held:
    """A tool's wait the operation handed over (``tasks.calls.operations.Waiting``), with its caller's slot:
    awaited on the face's event loop (:func:`waited`), no thread held."""

    waiting: operations.Waiting
    slot: shares.Slot | None


def _error_result(exc: Exception, face: Face) -> CallToolResult:
    err = errors.api_error(exc)
    if err is None:
        log.exception("unhandled error in MCP tool %s", face.name)
        err = errors.internal_error()
    return _result(errors.payload(err), err.status, is_error=True)


def call(face: Face, arguments: Arguments, caller: Caller, hand_over: bool = False) -> CallToolResult | Held:
    """Run one MCP tool for ``caller`` (always someone: the operators' unscoped door is not this face's):
    the REST operation's answer, or its error JSON with ``is_error``. With ``hand_over``, a ``wait`` is
    not waited here: a :class:`Held` is returned for :func:`waited`."""
    try:
        if not schema.GATE.passed:
            schema.GATE.require()  # a schema too old for this release: a 503 naming it, as REST answers
        bad = _bad_arguments(arguments)
        if bad is not None:
            raise bad
        path, query, body = face.split(arguments)
        slot = None
        if face.query is schemas.WaitQuery and shares.asks_to_wait(query):
            # a wait holds a slot of the caller's share (or 429) and of this process's capacity, never a web
            # thread of the process: served by the API's worker (app/mcp_lazy.py), it leaves them be
            slot = shares.wait_slot(caller.name, query["wait"], holds_thread=False)
        try:
            if hand_over and face.query is schemas.WaitQuery:
                answer = face.run(path, query, body, caller, hand_over=lambda waiting: Held(waiting, slot))
                if isinstance(answer, Held):
                    slot = None  # the wait's now: given back when it ends
                    return answer
            else:
                answer = face.run(path, query, body, caller)
            answer, status = answer
        finally:
            if slot is not None:
                slot.release()
    except Exception as exc:  # every error is answered as the REST API answers it
        return _error_result(exc, face)
    return _result(answer, status)


async def waited(face: Face, held: Held) -> CallToolResult:
    """The answer of a wait handed over: awaited on the process's stream loop (``models.listen``'s
    listener wakes it), holding no thread; its slot given back after."""
    waiting = held.waiting
    future = asyncio.run_coroutine_threadsafe(listen.until_settled_async(waiting.tool_call_id, waiting.seconds),
                                              stream_loop.loop())
    try:
        try:
            call_row, settled = await asyncio.wrap_future(future)
        except BaseException:
            future.cancel()
            raise
        answer, status = waiting.answer(call_row, settled)
    except Exception as exc:
        return _error_result(exc, face)
    finally:
        if held.slot is not None:
            await anyio.to_thread.run_sync(held.slot.release)
    return _result(answer, status)


def _caller(request: Any) -> Caller | None:
    return getattr(request.state, "caller", None) if isinstance(request, Request) else None


def _log_context(request: Any, arguments: Arguments) -> AbstractContextManager[None]:
    """The tool call's log context (see ``logs``), as the REST API's: the HTTP request's
    ``X-Request-ID`` or ``traceparent`` (else a new id), and the ids the arguments name."""
    headers = request.headers if isinstance(request, Request) else {}
    named = {key: arguments.get(key) for key in ("tool_call_id", "session_id") if isinstance(arguments.get(key), str)}
    traceparent = headers.get("traceparent")
    return logs.bound(request_id=logs.request_id(headers.get("x-request-id"), traceparent),
                      trace_id=logs.trace_id(traceparent), **named)


def mcp_tool(face: Face) -> Tool:
    """The face as MCP lists it: its name, description, argument JSON Schema and hints."""
    return Tool(name=face.name, description=face.description, input_schema=face.input_schema(),
                annotations=ToolAnnotations(read_only_hint=face.read_only,
                                            destructive_hint=False if face.read_only else None))


FACES_BY_NAME = {face.name: face for face in FACES}


@cache
def listed_tools() -> tuple[Tool, ...]:
    return tuple(mcp_tool(face) for face in FACES)


def _input_schema(name: str) -> Mapping[str, Any] | None:
    """A face's argument JSON Schema (the SDK checks ``Mcp-Param-*`` headers with it), or None."""
    return {tool.name: tool.input_schema for tool in listed_tools()}.get(name)


def nobody() -> CallToolResult:
    """The answer to a tool call that reached the server with no caller identified (no HTTP request with a
    token, e.g. the server run over another transport than ``create_mcp_app``'s): 401, nothing run."""
    err = callers.unauthorized("No caller identified: send Authorization: Bearer <token> over HTTP.")
    return _result(errors.payload(err), err.status, is_error=True)


def unknown_face(name: str) -> CallToolResult:
    err = ApiError(404, "not_found", f"No MCP tool {name!r}.", {"tool": name, "known_tools": sorted(FACES_BY_NAME)})
    return _result(errors.payload(err), err.status, is_error=True)


async def list_tools(ctx: ServerRequestContext[Any, Any], params: PaginatedRequestParams | None) -> ListToolsResult:
    return ListToolsResult(tools=list(listed_tools()))


async def call_tool(ctx: ServerRequestContext[Any, Any], params: CallToolRequestParams) -> CallToolResult:
    """``tools/call``: the arguments as the client sent them (raw JSON, no model of the SDK's in
    between) go to the REST schemas, which alone judge them, in a worker thread (the operation blocks);
    a ``wait`` it asks for is then awaited on the event loop, in no thread (:func:`waited`)."""
    face = FACES_BY_NAME.get(params.name)
    if face is None:
        return unknown_face(params.name)
    arguments: Arguments = dict(params.arguments or {})
    request = ctx.request
    caller = _caller(request)
    if caller is None:  # fail closed: a tool never runs unscoped (no caller is the operators' door)
        return nobody()

    def run() -> CallToolResult | Held:
        with _log_context(request, arguments), tracing.joined(arguments.get("tool_call_id"), f"mcp {face.name}"):
            return call(face, arguments, caller, hand_over=True)

    started = await anyio.to_thread.run_sync(run)
    if isinstance(started, Held):  # the wait: on the event loop, no thread held
        with _log_context(request, arguments):
            return await waited(face, started)
    return started


def server_version() -> str:
    return release.VERSION


def create_mcp_server() -> Server[Any]:
    """The SDK's low-level server with the tools handlers only: it advertises tools, and nothing else."""
    return Server(SERVER_NAME, version=server_version(), instructions=INSTRUCTIONS,
                  get_tool_input_schema=_input_schema, on_list_tools=list_tools, on_call_tool=call_tool)


# -- HTTP: the token, then the streamable-HTTP endpoint --------------------------------------

class BearerToken:
    """Refuse (401, the REST API's JSON) a request without a token of ``VOICE_TOOLS_API_TOKENS``, and
    (429) one past its caller's rate (``app/shares.py``, shared with the REST API); keep who it is
    (:class:`tasks.calls.callers.Caller`: its name, admin or not, asking through MCP) in ``request.state.caller``."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        try:
            caller = callers.through(callers.identify(Headers(scope=scope).get("authorization", "")), "MCP")
            shares.check_rate(caller.name)
        except ApiError as refused_here:
            refused = refused_here
        else:
            scope.setdefault("state", {})["caller"] = caller
            await self.app(scope, receive, send)
            return
        answer = JSONResponse(errors.payload(refused), status_code=refused.status, headers=refused.headers)
        await answer(scope, receive, send)


class EveryKeyOnce:
    """Refuse (400 ``bad_json``, naming the key, the REST API's JSON) a request whose JSON body gives a key
    twice, in the JSON-RPC envelope or in a tool's arguments: the SDK keeps the last of two, a proxy or a
    signer in front may read the first. The body is read here once (at most ``MAX_BODY_BYTES`` and a byte)
    and handed on as it came; a body past that, or not JSON, is the SDK's to answer."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        read: list[Message] = []
        size, complete = 0, False
        while not complete and size <= MAX_BODY_BYTES:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":  # the client went away: the app hears it too
                break
            size += len(message.get("body", b""))
            complete = not message.get("more_body", False)
        if complete:
            try:
                json.loads(b"".join(m.get("body", b"") for m in read), object_pairs_hook=json_keys.unique_object)
            except json_keys.DuplicateKey as exc:
                refused = json_keys.refused(exc, "request")
                await JSONResponse(errors.payload(refused), status_code=refused.status)(scope, receive, send)
                return
            except (ValueError, RecursionError):
                pass  # not JSON: the SDK answers it

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)


class JsonRefusals:
    """Every refusal of the MCP port in the REST API's JSON: an answer of 400 or more whose body is not
    JSON (Starlette's own 404 and 405, the SDK's plain-text ones such as a wrong Content-Type) gets the
    body REST gives that status, ``{error, message, details}``; its other headers (``Allow``) are kept.
    The framing's refusals, before the app, are :mod:`app.mcp_http`'s."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replaced: list[Message] = []  # the start of an answer whose body is replaced

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400 and \
                    not Headers(raw=message.get("headers", [])).get("content-type", "").startswith("application/json"):
                replaced.append(message)
                return
            if replaced and message["type"] == "http.response.body":
                if message.get("more_body"):
                    return  # the plain text: dropped
                start = replaced.pop()
                body = http_framing.body(start["status"], "Error")
                headers = [(name, value) for name, value in start.get("headers", [])
                           if name.lower() not in (b"content-type", b"content-length")]
                await send({**start, "headers": headers + [(b"content-type", b"application/json"),
                                                           (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, sending)


async def _healthz(_: Request) -> JSONResponse:
    return JSONResponse(schemas.HealthAnswer().dump({"status": "ok"}))


def create_mcp_app() -> Starlette:
    """The ASGI app: streamable HTTP at ``/mcp`` (stateless, JSON answers) and ``/healthz``, behind the token.

    The SDK's DNS-rebinding check (Host/Origin allowlist) is off: it guards servers that trust
    whoever reaches them, and every request here needs a bearer token a browser page does not have.
    """
    try:  # at start: one line if the schema does not fit this release (each tool call checks again)
        schema.GATE.verdict()
    except Exception:  # a database that does not answer: each tool call's own 503
        pass
    server = create_mcp_server()
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH, stateless_http=True, json_response=True,
        max_request_body_size=MAX_BODY_BYTES,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        custom_starlette_routes=[Route(HEALTH_PATH, _healthz, methods=["GET"])],
    )
    app.add_middleware(EveryKeyOnce)
    app.add_middleware(BearerToken)  # added last, run first: nothing is read for a request without a caller
    if tracing.started("mcp"):  # with OTEL_EXPORTER_OTLP_ENDPOINT set: a server span per request (app/server_spans.py)
        app.add_middleware(tracing.Middleware)
    app.add_middleware(JsonRefusals)  # outermost: every answer of the app passes it
    app.router.lifespan_context = _bounded_threads(app.router.lifespan_context)
    return app


def _bounded_threads(lifespan: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Run at most ``MCP_THREADS`` (default 16) operations at once: each is a blocking call in a
    worker thread (its ``wait`` is not: that is awaited on the event loop afterwards) that borrows
    pooled database connections, so the count stays within the pool (``VOICE_TOOLS_DB_POOL_SIZE`` +
    20 overflow) instead of anyio's 40."""
    @asynccontextmanager
    async def bounded(app: Any):
        anyio.to_thread.current_default_thread_limiter().total_tokens = int(os.environ.get("MCP_THREADS") or 16)
        async with lifespan(app) as state:
            yield state

    return bounded


UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")  # to the root's handler, in our format


def uvicorn_server(host: str, port: int, configure_logging: bool = True) -> Any:
    """A uvicorn server of the MCP face. ``configure_logging``: set up this process's logging in our format
    (a process of its own); else leave it as it is (uvicorn's loggers reach the root's handler, as in the
    API's gunicorn worker, whose logging gunicorn configured)."""
    import uvicorn

    log_config = logs.dict_config(loggers={name: {"level": "INFO"} for name in UVICORN_LOGGERS}) \
        if configure_logging else None
    from app.limits import KEEPALIVE_SECONDS
    from app.mcp_http import FramedH11Protocol

    config = uvicorn.Config(create_mcp_app(), host=host, port=port, log_level="info", log_config=log_config,
                            http=FramedH11Protocol, timeout_keep_alive=KEEPALIVE_SECONDS)
    return uvicorn.Server(config)


def serve(host: str, port: int, sockets: list[socket.socket] | None = None) -> None:
    """Serve the MCP face with uvicorn until interrupted (on ``sockets`` if given: already listening)."""
    uvicorn_server(host, port).run(sockets=sockets)
