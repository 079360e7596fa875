"""A callback's signatures, made and checked, in two schemes sent side by side:

- **Standard Webhooks** (https://www.standardwebhooks.com): ``webhook-id`` (the event_id),
  ``webhook-timestamp`` (Unix seconds) and ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of
  "<id>.<timestamp>.<body>">``, one per secret of ``VOICE_TOOLS_CALLBACK_SECRETS`` (``whsec_<base64>``
  each, newest first), separated by spaces, so a relay holding any of them verifies it during a
  rotation. :func:`sign_standard` makes the header (with the ``standardwebhooks`` package);
  :func:`verify_standard` checks one.
- **The older scheme**: ``X-Voice-Tools-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">``
  beside ``X-Voice-Tools-Timestamp`` (Unix seconds), keyed with ``VOICE_TOOLS_CALLBACK_SECRET``.
  :func:`sign` makes it; :func:`verify` checks it.

Both checks refuse a timestamp outside a replay window (5 minutes either side by default).
They are what a relay's receiver runs (the demo's, the tests' relay): the standard library and
``standardwebhooks`` (itself the standard library) only, so a light process imports this
module without Celery or SQLAlchemy.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from datetime import datetime, timezone
from typing import Iterable, Mapping, Tuple, Union

from standardwebhooks import Webhook

TIMESTAMP_HEADER = "X-Voice-Tools-Timestamp"
SIGNATURE_HEADER = "X-Voice-Tools-Signature"
TOLERANCE_S = 300  # a signature older or newer than this is refused (a replayed request)
PREFIX = "sha256="

# Standard Webhooks
ID_HEADER = "webhook-id"
STANDARD_TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
SECRET_PREFIX = "whsec_"
SECRET_BYTES = (24, 64)  # a secret's key, decoded, is 24 to 64 bytes (the scheme's advice)

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


def secret_error(secret: str) -> str | None:
    """Why ``secret`` is not a Standard Webhooks secret (``whsec_`` then the key in base64, 24 to 64
    bytes), or None when it is one."""
    if not secret.startswith(SECRET_PREFIX):
        return "does not start with whsec_"
    encoded = secret[len(SECRET_PREFIX):]
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        return "is not whsec_ followed by base64"
    if not SECRET_BYTES[0] <= len(key) <= SECRET_BYTES[1]:
        return f"holds a key of {len(key)} bytes (24 to 64 wanted)"
    return None


def parse_secrets(value: str) -> list[str]:
    """``VOICE_TOOLS_CALLBACK_SECRETS``: the comma-separated secrets, newest first, blanks dropped."""
    return [part.strip() for part in value.split(",") if part.strip()]


def new_secret(key_bytes: int = 32) -> str:
    """A fresh ``whsec_`` secret (what ``voice-tools run`` makes, and an operator's rotation may use)."""
    import secrets

    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(key_bytes)).decode()


def sign_standard(secrets: Iterable[str], msg_id: str, timestamp: str, body: bytes) -> str:
    """The ``webhook-signature`` value for ``body`` sent as message ``msg_id`` at ``timestamp``
    (Unix seconds): one ``v1,<base64>`` per secret, in the order given, separated by spaces.
    Each secret must pass :func:`secret_error` (ValueError otherwise)."""
    signatures = []
    when = datetime.fromtimestamp(int(timestamp), tz=timezone.utc)
    for secret in secrets:
        reason = secret_error(secret)
        if reason is not None:
            raise ValueError(f"a callback secret {reason}")
        signatures.append(Webhook(secret).sign(msg_id=msg_id, timestamp=when, data=body.decode()))
    if not signatures:
        raise ValueError("no Standard Webhooks secret to sign with")
    return " ".join(signatures)


def verify_standard(secrets: str | Iterable[str], headers: Mapping[str, str], body: bytes,
                    tolerance_s: float = TOLERANCE_S, now: float | None = None) -> bool:
    """Whether ``body`` (the raw bytes received) carries, in ``headers``, a Standard Webhooks
    signature made with one of ``secrets`` (a ``whsec_`` secret, or several: a relay during a
    rotation) at a ``webhook-timestamp`` within ``tolerance_s`` seconds of ``now`` (Unix seconds;
    the clock when None).

    Header names in any case. Every ``v1,`` signature of ``webhook-signature`` is tried against
    every secret, compared in constant time. A missing or malformed header, a timestamp outside
    the window (stale or in the future), a body that is not UTF-8, and no usable secret all
    verify nothing.
    """
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    keys = [key for key in keys if key and secret_error(key) is None]
    msg_id = _header(headers, ID_HEADER)
    timestamp = _header(headers, STANDARD_TIMESTAMP_HEADER)
    signature = _header(headers, STANDARD_SIGNATURE_HEADER)
    if not keys or not all(isinstance(value, str) and value for value in (msg_id, timestamp, signature)):
        return False
    if not (timestamp.isascii() and timestamp.isdigit()):
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > tolerance_s:
        return False
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return False
    given = []
    for versioned in signature.split(" "):
        version, _, encoded = versioned.partition(",")
        if version != "v1":
            continue
        try:
            given.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    when = datetime.fromtimestamp(int(timestamp), tz=timezone.utc)
    for key in keys:
        expected = base64.b64decode(Webhook(key).sign(msg_id=msg_id, timestamp=when, data=text).split(",", 1)[1])
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return True
    return False


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value from any mapping: as named, else by a case-blind look."""
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), None)
    return value
