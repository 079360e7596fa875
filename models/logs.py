"""Log lines: one JSON object per event, carrying the call it belongs to.

Every process of the Procfile (gunicorn, the Celery workers and beat, the MCP face)
writes its log with :func:`formatter` and :class:`ContextFilter`: one JSON line per
event with ``time``, ``level``, ``logger``, ``message``, ``pid``, ``version`` (the release) and the context bound
at that moment: ``request_id`` (the HTTP request, or the request whose chain a task
runs), ``trace_id`` (its W3C ``traceparent``'s, when it sent one; with tracing on, the trace's, and
``span_id``, the request's or the task's span: ``voice_tools_tracing/``), ``tool_call_id``,
``session_id``, and in a worker ``task_id``, ``task`` and ``step``. ``grep tc_...``
over every process's log then follows one call end to end.
``VOICE_TOOLS_LOG_FORMAT=text`` switches to one human line per event, the context at
its end. In both formats a control character (C0, DEL, C1) is never written raw: JSON escapes it,
text writes it ``\\xNN``, so what a client sent can neither forge a line nor reach a terminal as an
escape sequence.

The context lives in a :class:`contextvars.ContextVar`: the API binds it per request
(``app.request_log``), a worker per task (``tasks.worker.log_context``, Celery's signals),
and the publisher puts it in each task message's headers so a worker continues the
request that started the chain. This module is ground floor: app/ and tasks/ import
it, it imports neither.

Nothing secret is bound or logged here: ids only, never a token, a signature, a
parameter or a body.
"""
from __future__ import annotations

import logging
import os
import re
import uuid
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any, Iterator

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from models import release

FORMAT_VARIABLE = "VOICE_TOOLS_LOG_FORMAT"  # json (the default) | text
FIELDS = ("request_id", "trace_id", "span_id", "tool_call_id", "session_id", "task_id", "task", "step")
HEADER = "voice_tools_log"  # the task message header that carries the context to the worker

_context: ContextVar[dict[str, str]] = ContextVar("voice_tools_log_context", default={})


# -- the context -----------------------------------------------------------------------

def current() -> dict[str, str]:
    """The fields bound now (a copy)."""
    return dict(_context.get())


def bind(**fields: Any) -> Token:
    """Add ``fields`` (the empty ones are skipped) to the context; :func:`reset` undoes it."""
    merged = {**_context.get(), **{key: str(value) for key, value in fields.items() if value}}
    return _context.set(merged)


def add(**fields: Any) -> None:
    """Add ``fields`` for the rest of the request or task under way: its end resets the context
    to what it was before the request or task began, which undoes this too."""
    bind(**fields)


def reset(token: Token) -> None:
    _context.reset(token)


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    token = bind(**fields)
    try:
        yield
    finally:
        reset(token)


_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent`` header, else None."""
    found = _TRACEPARENT.match((traceparent or "").strip().lower())
    return found.group(1) if found and found.group(1) != "0" * 32 else None


def request_id(x_request_id: str | None = None, traceparent: str | None = None) -> str:
    """The request's id: a sane incoming ``X-Request-ID``, else a W3C ``traceparent``'s trace id,
    else a new one. Anything else sent is not trusted into the logs."""
    if x_request_id and _ID.match(x_request_id.strip()):
        return x_request_id.strip()
    return trace_id(traceparent) or uuid.uuid4().hex


# -- the records -----------------------------------------------------------------------

class ContextFilter(logging.Filter):
    """Puts the bound context on each record (a field the call itself passed in ``extra`` wins).

    Celery's own worker lines pass the task in ``extra={"data": {...}}`` with its args'
    repr and return value: only its id and name are kept (``task_id``, ``task``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            if key not in record.__dict__:
                record.__dict__[key] = value
        data = record.__dict__.pop("data", None) if record.name.startswith("celery.") else None
        if isinstance(data, dict):
            record.__dict__.setdefault("task_id", data.get("id"))
            record.__dict__.setdefault("task", data.get("name"))
        return True


# Not fields of the line: logging's own attributes and uvicorn's coloured copy of the message.
_NOT_FIELDS = (*RESERVED_ATTRS, "color_message")


# The control characters (Unicode Cc: C0, DEL, C1): never raw in a line, in any format.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def _escape(found: re.Match) -> str:
    return "\\x%02x" % ord(found.group())


def escaped(text: str, newlines: bool = False) -> str:
    """``text`` with each control character written ``\\xNN`` (a newline too, unless ``newlines``)."""
    return (_CONTROL_BUT_NEWLINE if newlines else _CONTROL).sub(_escape, text)


class JsonLines(JsonFormatter):
    """One JSON object a line: every control character is a JSON escape (``\\u009b``), DEL too."""

    def __init__(self) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s %(process)d",
            rename_fields={"levelname": "level", "name": "logger", "process": "pid"},
            reserved_attrs=_NOT_FIELDS,
            static_fields={"version": release.VERSION},  # the release that wrote the line
            timestamp="time",
        )

    def jsonify_log_record(self, log_data: Any) -> str:
        # ensure_ascii escapes C0 and C1 (and all non-ASCII); DEL is ASCII, escaped here
        return super().jsonify_log_record(log_data).replace("\x7f", "\\u007f")


class TextLines(logging.Formatter):
    """``time level logger: message [field=value ...]``, then a traceback's lines if any. Every control
    character of the message, the fields and the traceback is written ``\\xNN`` (a traceback keeps its
    own line ends), so a line is one line and a terminal shown it runs no escape sequence."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        context = " ".join(f"{key}={record.__dict__[key]}" for key in FIELDS if record.__dict__.get(key))
        return escaped(f"{line} [{context}]" if context else line)

    def formatException(self, ei: Any) -> str:
        return escaped(super().formatException(ei), newlines=True)

    def formatStack(self, stack_info: str) -> str:
        return escaped(super().formatStack(stack_info), newlines=True)


def log_format(environ: Any = None) -> str:
    """``json`` unless ``VOICE_TOOLS_LOG_FORMAT`` (in ``environ``, else this process's) says ``text``."""
    chosen = (os.environ if environ is None else environ).get(FORMAT_VARIABLE, "json")
    return "text" if chosen.strip().lower() == "text" else "json"


def formatter() -> logging.Formatter:
    """The formatter of ``VOICE_TOOLS_LOG_FORMAT`` (json unless it says text)."""
    return TextLines() if log_format() == "text" else JsonLines()


def adopt(logger: logging.Logger) -> None:
    """Give every handler of ``logger`` (set up by someone else: Celery, uvicorn) our format and context."""
    for handler in logger.handlers:
        handler.setFormatter(formatter())
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())


def stderr_handler() -> logging.Handler:
    handler = logging.StreamHandler()
    handler.setFormatter(formatter())
    handler.addFilter(ContextFilter())
    return handler


def line(level: int, logger: str, message: str) -> str:
    """One line as a logger would write it, for the few places that must not log (signal handlers)."""
    record = logging.LogRecord(logger, level, __file__, 0, message, None, None)
    ContextFilter().filter(record)
    return formatter().format(record)


def dict_config(level: str = "INFO", loggers: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` that sends the root logger (and ``loggers``) to
    stderr in our format: for gunicorn's ``logconfig_dict`` and uvicorn's ``log_config``."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter}},
        "formatters": {"lines": {"()": formatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                                "formatter": "lines", "filters": ["context"]}},
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": loggers or {},
    }
