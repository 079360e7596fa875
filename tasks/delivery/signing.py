"""A callback's signature, made and checked: ``X-Voice-Tools-Signature: sha256=<hex HMAC-SHA256
of "<timestamp>.<body>">`` beside ``X-Voice-Tools-Timestamp`` (Unix seconds).

:func:`sign` is what a delivery sends; :func:`verify` is what a relay's receiver runs (the
demo's, the tests' relay): the standard library only, so a light process imports it
without Celery or SQLAlchemy.
"""
from __future__ import annotations

import hashlib
import hmac
import time
from typing import Mapping, Tuple, Union

TIMESTAMP_HEADER = "X-Voice-Tools-Timestamp"
SIGNATURE_HEADER = "X-Voice-Tools-Signature"
TOLERANCE_S = 300  # a signature older or newer than this is refused (a replayed request)
PREFIX = "sha256="

HeadersOrValues = Union[Mapping[str, str], Tuple[str, str]]


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp``."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return PREFIX + digest


def verify(secret: str, headers_or_values: HeadersOrValues, body: bytes, tolerance_s: float = TOLERANCE_S,
           now: float | None = None) -> bool:
    """Whether ``body`` (the raw bytes received) was signed with ``secret`` at a timestamp within
    ``tolerance_s`` seconds of ``now`` (Unix seconds; the clock when None).

    ``headers_or_values``: the request's headers (any mapping; names in any case) or the
    pair ``(timestamp, signature)``. The signatures are compared in constant time. A
    missing or malformed header, a timestamp outside the window (stale or in the future)
    and an empty secret all verify nothing.
    """
    if isinstance(headers_or_values, tuple):
        timestamp, signature = headers_or_values
    else:
        timestamp = _header(headers_or_values, TIMESTAMP_HEADER)
        signature = _header(headers_or_values, SIGNATURE_HEADER)
    if not secret or not isinstance(timestamp, str) or not isinstance(signature, str):
        return False
    if not (timestamp.isascii() and timestamp.isdigit()) or not signature.startswith(PREFIX):
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body).encode(), signature.encode())


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value from any mapping: as named, else by a case-blind look."""
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), None)
    return value
