"""Who asks: the caller named by a Bearer token of ``VOICE_TOOLS_API_TOKENS``.

The variable is a comma-separated list of ``name:token`` or ``name:token:admin``; a bare
``token`` is named by the first 8 hex characters of its SHA-256. The token's name is
recorded as a call's ``caller``; a caller sees only its own calls, session context and
events, and an ``:admin`` token (an operator's) sees all. With no tokens configured every
token is refused (fail closed). A name longer than the ``caller`` column (100 characters)
is a configuration error: its token is refused with a 401 that says so (never truncated,
which could make two callers one).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import logging
from dataclasses import dataclass

from models import lifecycle, settings
from tasks.calls.errors import ApiError

log = logging.getLogger(__name__)

MAX_NAME = 100  # tool_calls.caller

ADMIN_MARK = "admin"


@dataclass(frozen=True)
class Caller:
    """Who asks: the token's name, whether it is an operator's (``:admin``), and the face it asks
    through (``via``: REST unless the face says otherwise; one of ``models.lifecycle.FACES``)."""

    name: str
    admin: bool = False
    via: str = "REST"

    @property
    def scope(self) -> str | None:
        """The ``caller`` the request's reads and actions are limited to; None (everything) for an admin."""
        return None if self.admin else self.name


def entries_of(entries: list[str]) -> list[tuple[str, bytes, bool]]:
    """``[(name, token, admin)]`` from the variable's entries (parsed once per value of the variable)."""
    return _entries(tuple(entries))


@functools.lru_cache(maxsize=8)
def _entries(entries: tuple[str, ...]) -> list[tuple[str, bytes, bool]]:
    found = []
    for entry in entries:
        name, sep, token = entry.partition(":")
        admin = False
        if not sep:
            name, token = hashlib.sha256(entry.encode()).hexdigest()[:8], entry
        else:
            token, mark_sep, mark = token.partition(":")
            if mark_sep and mark.strip() == ADMIN_MARK:
                admin = True
            elif mark_sep:  # not a mark we know: the colon belongs to the token
                token = f"{token}:{mark}"
        if token:
            found.append((name.strip(), token.strip().encode(), admin))
    return found


def who_for(presented: str, entries: list[str]) -> Caller | None:
    """The caller of the token presented, or None; compares against every token in constant time."""
    given = presented.encode()
    match = None
    for name, token, admin in entries_of(entries):
        if hmac.compare_digest(given, token) and match is None:
            match = Caller(name, admin)
    return match


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, {}, {"WWW-Authenticate": 'Bearer realm="voice-tools"'})


def identify(authorization: str) -> Caller:
    """The caller named by an ``Authorization`` header's Bearer token; :class:`ApiError` 401 otherwise."""
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise unauthorized("Send Authorization: Bearer <token>.")
    who = who_for(presented.strip(), settings.api_tokens())
    if who is None:
        raise unauthorized("Unknown API token.")
    if len(who.name) > MAX_NAME:
        log.error("VOICE_TOOLS_API_TOKENS names a token %r..., longer than %d characters: refused",
                  who.name[:20], MAX_NAME)
        raise unauthorized(f"This token's name in VOICE_TOOLS_API_TOKENS is longer than {MAX_NAME} characters; "
                           "an operator must shorten it.")
    return who


def name_of(caller: Caller | None) -> str | None:
    """The name recorded as a new call's ``caller`` (None: the operator's unscoped door)."""
    return caller.name if caller is not None else None


def acted(caller: Caller | None) -> dict[str, str]:
    """Who acted and through which face, for the history entry an action adds (none: unscoped and unnamed)."""
    return {} if caller is None else {"by": caller.name, "via": caller.via}


def cancel_reason(caller: Caller | None) -> str:
    """A cancel's reason when none is given, true to who asked: a caller's own token speaks for its user
    (the relays' default, ``Cancelled by user``); an operator's (an admin token, the CLI) says an operator did."""
    if caller is not None and caller.admin:
        return lifecycle.OPERATOR_CANCEL_REASON
    return lifecycle.DEFAULT_CANCEL_REASON


def through(caller: Caller, via: str) -> Caller:
    """The same caller, asking through face ``via``."""
    return dataclasses.replace(caller, via=via)


def scope_of(caller: Caller | None) -> str | None:
    """Whose calls a request may see and act on: the caller's own, or everyone's (None) for an
    admin or the operator's unscoped door."""
    return caller.scope if caller is not None else None
