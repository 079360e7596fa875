"""Each run of a call's links, as the call keeps it (``tool_calls.link_attempts``, migration 0022).

An entry is ``{"step", "started_at", "took_ms", "outcome", "reason"}``: when the run began (the
worker's clock), how long it took up to the statement that records it, ``done``, ``retried`` or
``failed``, and for a retried or failed run its error's class and a short message. The run's own
statement appends it (its step's record, its retry's count, its failure: no statement is added),
and only the latest :data:`KEPT` are kept, so the column stays small however often a step is retried.

A reason says why, never with what: the product's own errors (a tool's, a backend's, whose text is
made of the call's parameters and what they found) give their class alone; another library's its
message's first line, cut to :data:`REASON_CHARS` and stripped of what a URL may carry (credentials,
a query string).
"""
from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Integer, case, func, literal_column
from sqlalchemy.sql.elements import ColumnElement

KEPT = 20
REASON_CHARS = 160
DONE, RETRIED, FAILED = "done", "retried", "failed"

_URL_SECRETS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/\s@]*@|(?P<query>\?[^\s#]*)", re.IGNORECASE)


# The product's own errors (a tool's, a backend's): their text is a sentence for the person, made of the
# call's parameters and of the data they found (a meeting's title): never a reason's
_SPOKEN = ("tasks", "voice_tools", "voice_tools_backends")  # top-level packages


def reason_of(error: BaseException) -> str:
    """``<class>: <message>``, short: why, never with what. The product's own errors (:data:`_SPOKEN`) say
    their class alone; another library's, the first line of its message (a database error's ``DETAIL``,
    with a row's values, is on the next), without a URL's credentials or query string."""
    spoken = type(error).__module__.partition(".")[0] in _SPOKEN
    first = "" if spoken else (str(error).strip().splitlines() or [""])[0]
    message = _URL_SECRETS.sub(lambda m: m.group("scheme") or "?…", " ".join(first.split()))
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def entry(step: str, started_at: float, took_s: float, outcome: str,
          error: BaseException | str | None = None) -> dict[str, Any]:
    """One run's entry: ``started_at`` a Unix time, ``took_s`` seconds (kept to the microsecond),
    ``error`` the run's error, or its reason already said."""
    return {"step": step, "started_at": datetime.fromtimestamp(started_at, timezone.utc).isoformat(),
            "took_ms": round(took_s * 1000, 3), "outcome": outcome,
            "reason": error if isinstance(error, str) or error is None else reason_of(error)}


def appended(column: Any, item: Any) -> ColumnElement[Any]:
    """``column`` with ``item`` (a JSONB value or parameter) added last, its oldest entry dropped past :data:`KEPT`."""
    grown = column.op("||")(func.jsonb_build_array(item))
    return case((func.jsonb_array_length(column) >= KEPT, grown.op("-")(literal_column("0", Integer))), else_=grown)
