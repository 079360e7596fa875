"""Checking a callback's Standard Webhooks signature (``webhook-id``, ``webhook-timestamp``,
``webhook-signature``) with the ``standardwebhooks`` package."""
from __future__ import annotations

import base64
import binascii
import hmac
import json
import time
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Union

from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

TOLERANCE_S = 300


class SignatureError(WebhookVerificationError):
    """A callback that must not be trusted: the reason is the message (a missing header, a stale or
    future timestamp, no signature made with any of the secrets)."""


def _header(headers: Mapping[str, str], name: str) -> Union[str, None]:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def trace_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context a callback carries (``traceparent``, and ``tracestate`` when sent), when the
    server traces: hand it to your tracer's propagator (OpenTelemetry: ``opentelemetry.propagate.extract``)
    and the relay's handling of the event continues the call's trace. {} when the callback has none."""
    found = {name: _header(headers, name) for name in ("traceparent", "tracestate")}
    return {name: value for name, value in found.items() if value} if found["traceparent"] else {}


def verify(headers: Mapping[str, str], body: Union[bytes, str], secrets: Union[str, Iterable[str]],
           tolerance: float = TOLERANCE_S) -> dict[str, Any]:
    """The callback's event (its JSON body as a dict) when ``body`` (the raw bytes received) carries a
    ``webhook-signature`` made with one of ``secrets`` (one ``whsec_…`` secret, or several while the
    sender rotates them: any may match) at a ``webhook-timestamp`` within ``tolerance`` seconds of now.

    Raises :class:`SignatureError` (a ``standardwebhooks`` ``WebhookVerificationError``) otherwise.
    """
    keys = [secrets] if isinstance(secrets, str) else [s for s in secrets if s]
    if not keys:
        raise SignatureError("no secret to verify with")
    webhooks = [Webhook(key) for key in keys]
    try:
        text = body if isinstance(body, str) else body.decode("utf-8")
    except UnicodeDecodeError:
        raise SignatureError("the body is not UTF-8") from None
    msg_id = _header(headers, "webhook-id")
    stamp = _header(headers, "webhook-timestamp")
    signature = _header(headers, "webhook-signature")
    if not (msg_id and stamp and signature):
        raise SignatureError("missing webhook-id, webhook-timestamp or webhook-signature")
    if not (stamp.isascii() and stamp.isdigit()):
        raise SignatureError(f"webhook-timestamp {stamp!r} is not Unix seconds")
    age = time.time() - int(stamp)
    if age > tolerance:
        raise SignatureError(f"timestamp too old ({age:.0f} s, at most {tolerance:g} s)")
    if age < -tolerance:
        raise SignatureError(f"timestamp too new ({-age:.0f} s ahead, at most {tolerance:g} s)")
    given = []
    for versioned in signature.split(" "):
        version, _, encoded = versioned.partition(",")
        if version == "v1":
            try:
                given.append(base64.b64decode(encoded, validate=True))
            except (binascii.Error, ValueError):
                continue
    when = datetime.fromtimestamp(int(stamp), tz=timezone.utc)
    for webhook in webhooks:
        expected = base64.b64decode(webhook.sign(msg_id=msg_id, timestamp=when, data=text).split(",", 1)[1])
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return json.loads(text)
    raise SignatureError("no signature matches any of the secrets (wrong secret or a changed body)")
