"""The API answers every error as JSON ``{error, message, details}``, never an HTML page.

Flask error handlers: the exceptions an operation raises are answered as
``tasks.calls.errors.api_error`` maps them (the MCP face and the operator CLI answer the
same body), Werkzeug's HTTP errors under the codes relays match on, and an unforeseen
exception as a JSON 500 (logged), never a stack trace.
"""
from __future__ import annotations

import logging
from typing import Any

from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

from tasks.calls.errors import KNOWN, ApiError, api_error, internal_error, payload

log = logging.getLogger(__name__)

# Werkzeug's HTTP errors under the codes relays match on.
HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
}


# Short sentences instead of Werkzeug's paragraphs.
HTTP_MESSAGES = {
    404: "No such endpoint.",
    405: "This method is not allowed here.",
}


def response(err: ApiError):
    return jsonify(payload(err)), err.status, err.headers


def register(app: Flask) -> None:
    def _known(err: Exception):
        return response(api_error(err) or internal_error())

    for kind in KNOWN:
        app.register_error_handler(kind, _known)

    @app.errorhandler(HTTPException)
    def _http(err: HTTPException):
        status = err.code or 500
        code = HTTP_CODES.get(status, (err.name or "error").lower().replace(" ", "_"))
        details: dict[str, Any] = {}
        headers: dict[str, str] = {}
        if status == 405:
            allowed = err.valid_methods if hasattr(err, "valid_methods") else None  # type: ignore[attr-defined]
            details["allowed"] = sorted(allowed or [])
            headers["Allow"] = ", ".join(details["allowed"])
        if status == 413:
            details["max_bytes"] = app.config.get("MAX_CONTENT_LENGTH")  # its body unread: app.inputs closes
        message = HTTP_MESSAGES.get(status) or err.description or err.name
        if status == 413:
            message = f"The body is larger than {details['max_bytes']} bytes."
        return response(ApiError(status, code, message, details, headers))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        if isinstance(err, HTTPException):  # pragma: no cover (handled above)
            return _http(err)
        log.exception("unhandled error")
        return response(internal_error())
