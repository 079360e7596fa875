"""Every error an operation gives is ``{error, message, details}`` with an HTTP status (the API's JSON errors).

Operations raise :class:`ApiError` (or let a validation/lifecycle/chains/database
exception through); :func:`api_error` is the one mapping from an exception to its
status, code and message, on every face: the Flask handlers (``app.errors``), the MCP
tools (``app.mcp_server``) and the operator CLI answer the same :func:`payload`.
"""
from __future__ import annotations

import logging
from typing import Any

from marshmallow import ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError

from tasks.calls import schemas
from models import lifecycle, queries, schema
from tasks import chains, tools

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An answer of the error vocabulary: HTTP ``status``, code ``error``, a sentence, ``details``, ``headers``."""

    def __init__(self, status: int, error: str, message: str, details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.details = details or {}
        self.headers = headers or {}


class UnknownTool(LookupError):
    """The call's tool is not one this process runs (removed since the call was recorded, or
    recorded by a newer release behind the same load balancer): a 422 naming the known tools."""

    def __init__(self, tool_call_id: str, function_name: str):
        super().__init__(f"Unknown tool {function_name!r}: this server does not run it.")
        self.tool_call_id = tool_call_id
        self.function_name = function_name


def validation_error(messages: Any, extra: dict[str, Any] | None = None) -> ApiError:
    """422 naming each invalid field (marshmallow's messages under ``details.fields``)."""
    if not isinstance(messages, dict):
        messages = {"_schema": messages if isinstance(messages, list) else [str(messages)]}
    details: dict[str, Any] = {"fields": messages}
    details.update(extra or {})
    names = ", ".join(sorted(_field_paths(messages)))
    return ApiError(422, "validation_error", f"Invalid fields: {names}.", details)


def _field_paths(messages: dict[Any, Any], prefix: str = "") -> list[str]:
    """``{"parameters": {"to": [...]}}`` -> ``["parameters.to"]``: the message names the leaf fields."""
    paths: list[str] = []
    for key, value in messages.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            paths.extend(_field_paths(value, path + "."))
        else:
            paths.append(path)
    return paths


def _known_tools(messages: Any) -> dict[str, Any]:
    """An unknown tool's 422 lists the known ones in ``details.known_tools``."""
    if isinstance(messages, dict):
        for key in ("function", "function_name"):
            if any(str(m).startswith(schemas.UNKNOWN_TOOL) for m in messages.get(key, [])):
                return {"known_tools": tools.names()}
    return {}


def refused(exc: lifecycle.Refused) -> ApiError:
    return ApiError(409, exc.code, str(exc), {"status": exc.status, "tool_call_id": exc.call.tool_call_id})


def not_found(tool_call_id: str) -> ApiError:
    return ApiError(404, "not_found", f"No tool call {tool_call_id}.", {"tool_call_id": tool_call_id})


# A 503's Retry-After: what is down (a restart, a failover, a migration) is back in seconds; a publish
# refused (the broker does not answer, or every pooled connection stayed taken for the pool's acquire
# timeout) a little later: a broker restart or a burst of publishes is over within seconds.
RETRY_AFTER_S = 1
BROKER_RETRY_AFTER_S = 2


def unavailable(service: str, reason: str, retry_after: int = RETRY_AFTER_S, message: str | None = None,
                **details: Any) -> ApiError:
    return ApiError(503, "unavailable", message or f"The {service} is unavailable; try again in {retry_after} s.",
                    {"service": service, "reason": reason[:300], "retry_after": retry_after, **details},
                    {"Retry-After": str(retry_after)})


def schema_too_old(exc: schema.SchemaTooOld) -> ApiError:
    """This process's release needs a newer schema than the database's: nothing is served until it is migrated."""
    return unavailable("database", "schema", message=f"Not serving: {exc}.", found=exc.verdict.found,
                       needed=schema.OLDEST)


def api_error(exc: Exception) -> ApiError | None:
    """The ApiError an exception raised by an operation is answered with, on every face
    (the REST views, the MCP tools, the operator CLI); None for an exception we do not know (a 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error(exc.messages, _known_tools(exc.messages))
    if isinstance(exc, queries.NotFound):
        return not_found(exc.tool_call_id)
    if isinstance(exc, lifecycle.Refused):
        return refused(exc)
    if isinstance(exc, lifecycle.IdTaken):  # another caller's call: nothing of it, not even its status
        return ApiError(409, "idempotency_conflict", str(exc), {"tool_call_id": exc.tool_call_id})
    if isinstance(exc, UnknownTool):
        return validation_error({"function_name": [str(exc)]},
                                {"known_tools": tools.names(), "tool_call_id": exc.tool_call_id})
    if isinstance(exc, chains.BrokerUnavailable):
        return unavailable("broker", str(exc), BROKER_RETRY_AFTER_S)
    if isinstance(exc, schema.SchemaTooOld):
        return schema_too_old(exc)
    if isinstance(exc, (OperationalError, InterfaceError)):
        log.warning("database unavailable: %s", exc)
        return unavailable("database", str(getattr(exc, "orig", exc)).strip())
    return None


def internal_error() -> ApiError:
    return ApiError(500, "internal_error", "Something went wrong on our side.", {})


def payload(err: ApiError) -> dict[str, Any]:
    """The JSON body of an error: ``{error, message, details}``."""
    return {"error": err.error, "message": err.message, "details": err.details}


# what :func:`api_error` maps (the Flask face registers a handler for each)
KNOWN = (ApiError, ValidationError, queries.NotFound, lifecycle.Refused, lifecycle.IdTaken,
         chains.BrokerUnavailable, UnknownTool, OperationalError, InterfaceError, schema.SchemaTooOld)
