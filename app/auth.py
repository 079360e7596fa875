"""Bearer tokens from ``VOICE_TOOLS_API_TOKENS`` (CONTRACT section 1).

The variable is a comma-separated list of ``name:token``; a bare ``token`` is named
by the first 8 hex characters of its SHA-256. Every endpoint but ``/healthz`` needs
one; the token's name is kept in ``g.caller`` and recorded as the call's ``caller``.
With no tokens configured every request is refused (fail closed). A name longer than
the ``caller`` column (100 characters) is a configuration error: its token is refused
with a 401 that says so (never truncated, which could make two callers one).
"""
from __future__ import annotations

import hashlib
import hmac

import logging

from flask import Flask, g, request

from app.errors import ApiError
from models import settings

log = logging.getLogger(__name__)

MAX_NAME = 100  # tool_calls.caller

OPEN_PATHS = frozenset({"/healthz"})


def tokens(entries: list[str]) -> list[tuple[str, bytes]]:
    """``[(name, token)]`` from the variable's entries."""
    found = []
    for entry in entries:
        name, sep, token = entry.partition(":")
        if not sep:
            name, token = hashlib.sha256(entry.encode()).hexdigest()[:8], entry
        if token:
            found.append((name.strip(), token.strip().encode()))
    return found


def caller_for(presented: str, entries: list[str]) -> str | None:
    """The name of the token presented, or None; compares against every token in constant time."""
    given = presented.encode()
    match = None
    for name, token in tokens(entries):
        if hmac.compare_digest(given, token) and match is None:
            match = name
    return match


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, {}, {"WWW-Authenticate": 'Bearer realm="voice-tools"'})


def identify(authorization: str) -> str:
    """The caller named by an ``Authorization`` header's Bearer token; :class:`ApiError` 401 otherwise."""
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise unauthorized("Send Authorization: Bearer <token>.")
    caller = caller_for(presented.strip(), settings.load().api_tokens)
    if caller is None:
        raise unauthorized("Unknown API token.")
    if len(caller) > MAX_NAME:
        log.error("VOICE_TOOLS_API_TOKENS names a token %r..., longer than %d characters: refused",
                  caller[:20], MAX_NAME)
        raise unauthorized(f"This token's name in VOICE_TOOLS_API_TOKENS is longer than {MAX_NAME} characters; "
                           "an operator must shorten it.")
    return caller


def register(app: Flask) -> None:
    @app.before_request
    def _check_token() -> None:
        if request.path in OPEN_PATHS:
            return
        g.caller = identify(request.headers.get("Authorization", ""))
