"""Reading a Flask request: the JSON body (any content type: a relay's curl may send none) and
the query string, as plain data for the operations of ``tasks.calls``, which load them with
their schemas (``tasks.calls.schemas.load``, named ``load`` here too for ``app.stream``).

An answer given while the request's body is still unread (413 too large, 401 before the body,
any view that never read it) says ``Connection: close``, and gunicorn closes the connection
(``app/gunicorn_conf.py`` makes it honour the header): the unread bytes are never taken for the
client's next request."""
from __future__ import annotations

import json
import math
from typing import Any

from flask import Flask, Response, current_app, g, request
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wsgi import get_input_stream

from app import json_keys, request_log
from app.json_depth import MAX_DEPTH, depth
from tasks.calls.errors import ApiError


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def raw_body() -> bytes:
    """The body's bytes; 413 past ``MAX_CONTENT_LENGTH``, with or without a Content-Length.

    With a Content-Length over the limit Werkzeug refuses before reading. A body sent
    without one (``Transfer-Encoding: chunked``) is read through a stream capped at the
    limit, which Werkzeug's own reading stops at silently, so a longer body would come
    out cut (a JSON error, or worse a padded body that parses): it is read here with a
    cap one byte higher, and a byte past the limit is a 413.
    """
    limit = current_app.config.get("MAX_CONTENT_LENGTH")
    if request.content_length is not None or limit is None:
        raw = request.get_data(cache=True)  # raises 413 past MAX_CONTENT_LENGTH
        g.body_read = True
        return raw
    raw = get_input_stream(request.environ, max_content_length=limit + 1).read()  # stops at limit + 1
    if len(raw) > limit:
        raise RequestEntityTooLarge()
    g.body_read = True
    return raw


def utf8(raw: bytes) -> str:
    """The body's text: UTF-8 alone (RFC 8259), as the MCP face reads it. A byte order mark, UTF-16 or
    UTF-32 (which ``json.loads`` of bytes would guess) is a ``UnicodeDecodeError``: one reading of a body,
    so a proxy or a signer sees the request that is run."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raise UnicodeDecodeError("utf-8", raw, 0, 3, "a byte order mark")
    nul = raw.find(b"\x00")  # never in JSON text; UTF-16 or UTF-32 without a BOM decodes as UTF-8 with them
    if nul >= 0:
        raise UnicodeDecodeError("utf-8", raw, nul, nul + 1, "a NUL byte (UTF-16 or UTF-32?)")
    return raw.decode("utf-8")


def body() -> dict[str, Any]:
    """The body as a JSON object (UTF-8, :func:`utf8`); an empty body is ``{}``. 400 for anything else
    (a key given twice too, naming it), 413 if too large."""
    raw = raw_body()
    if not raw.strip():
        return {}
    try:
        text = utf8(raw)
    except UnicodeDecodeError as exc:
        raise ApiError(400, "bad_json", "The body must be UTF-8, with no byte order mark.",
                       {"reason": f"{exc.reason} at byte {exc.start}"}) from exc
    try:
        data = json.loads(text, parse_float=_finite, parse_constant=_no_constant,
                          object_pairs_hook=json_keys.unique_object)
    except json_keys.DuplicateKey as exc:
        raise json_keys.refused(exc) from exc
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "bad_json", "The body is not valid JSON.", {"reason": str(exc)[:200]}) from exc
    if not isinstance(data, dict):
        raise ApiError(400, "bad_json", "The body must be a JSON object.", {"type": type(data).__name__})
    if depth(data) > MAX_DEPTH:
        raise ApiError(400, "bad_json", f"The body nests deeper than {MAX_DEPTH} levels.", {"max_depth": MAX_DEPTH})
    request_log.bind_ids(data)  # the call and session the body names, on the request's log lines
    return data


def query() -> dict[str, Any]:
    """The query string; a repeated key keeps its first value."""
    return {key: request.args.get(key) for key in request.args}


def _has_body() -> bool:
    return bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()


def register(app: Flask) -> None:
    @app.after_request
    def _close_after_an_unread_body(response: Response) -> Response:
        if _has_body() and not g.get("body_read"):
            response.headers["Connection"] = "close"
        return response
