"""Reading a Flask request: the JSON body (any content type: a relay's curl may send none) and
the query string, as plain data for the operations of ``tasks.calls``, which load them with
their schemas (``tasks.calls.schemas.load``, named ``load`` here too for ``app.stream``)."""
from __future__ import annotations

import json
import math
from typing import Any

from flask import current_app, request
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
        return request.get_data(cache=True)  # raises 413 past MAX_CONTENT_LENGTH
    raw = get_input_stream(request.environ, max_content_length=limit + 1).read()  # stops at limit + 1
    if len(raw) > limit:
        raise RequestEntityTooLarge()
    return raw


def body() -> dict[str, Any]:
    """The body as a JSON object; an empty body is ``{}``. 400 for anything else (a key given twice
    too, naming it), 413 if too large."""
    raw = raw_body()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw, parse_float=_finite, parse_constant=_no_constant,
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
