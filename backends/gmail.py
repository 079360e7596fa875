"""Sending email through Gmail (``users.messages.send``), never twice for one call.

Chosen by the send_email tool when ``settings.load().uses_google("gmail")``; the local
outbox (``backends/email.py``) is the default.

The message carries a ``Message-ID`` fixed from the tool_call_id
(``email.message_id_for``). Before sending, the mailbox is searched for it
(``users.messages.list`` with ``q="rfc822msgid:..."``, spam and trash included): if
it is there, an earlier run of the same link already sent it (a worker killed
mid-send, or a 5xx / timeout whose send went through anyway) and that message is
returned instead of sending again. The search needs the ``gmail.readonly`` scope
besides ``gmail.send`` (``gmail.metadata`` does not allow ``q``); see
``backends.google.SCOPES``.

Errors: :class:`Refused` when Google refused the request (400, 401, 403 other than a
rate limit, 404; unreadable credentials): nothing was sent by it. :class:`Unavailable`
for a 403 rate limit or a transport failure: worth retrying. 429 and 5xx
``HttpError``\\ s, timeouts and connection errors go through as they are (the engine
retries them).
"""
from __future__ import annotations

import base64
import json
from email.message import EmailMessage
from email.policy import SMTP
from typing import Any

from google.auth.exceptions import RefreshError

from backends import google
from backends.google import HttpError
from backends import Refused, Unavailable

USER = "me"
REFUSED_STATUSES = frozenset({400, 401, 403, 404})
RATE_LIMIT_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
POLICY = SMTP.clone(cte_type="7bit")  # CRLF lines; a non-ASCII body goes quoted-printable or base64




def mime_message(draft: dict[str, Any]) -> EmailMessage:
    """The RFC 5322 message of a draft: To, Cc, Subject, our fixed Message-ID, a plain-text body."""
    msg = EmailMessage(policy=POLICY)
    msg["To"] = draft["to"]
    if draft.get("cc"):
        msg["Cc"] = ", ".join(draft["cc"])
    msg["Subject"] = draft["subject"]
    msg["Message-ID"] = draft["message_id"]
    msg.set_content(draft.get("body") or "")
    return msg


def raw_of(draft: dict[str, Any]) -> str:
    """The message as Gmail wants it: base64url of the RFC 5322 bytes."""
    return base64.urlsafe_b64encode(mime_message(draft).as_bytes()).decode("ascii")


def search_query(message_id: str) -> str:
    """Gmail's search for a Message-ID (``rfc822msgid:`` takes it without the angle brackets)."""
    return "rfc822msgid:" + message_id.strip().strip("<>")


def find_sent(service: Any, message_id: str) -> dict[str, Any] | None:
    """The mailbox's message with this Message-ID (``{id, threadId}``), or None."""
    found = service.users().messages().list(userId=USER, q=search_query(message_id),
                                            includeSpamTrash=True).execute()
    messages = found.get("messages") or []
    return messages[0] if messages else None


def send(tool_call_id: str, draft: dict[str, Any], service: Any = None) -> dict[str, Any]:
    """Send the draft once; return ``{message_id, thread_id, to}`` (``message_id``: Gmail's message id).

    ``service`` (a ``gmail`` v1 client) defaults to this thread's client from the settings.
    """
    try:
        service = service or google.service("gmail", "v1")
        sent = find_sent(service, draft["message_id"])
        if sent is None:
            sent = service.users().messages().send(userId=USER, body={"raw": raw_of(draft)}).execute()
    except HttpError as exc:
        meaning = _meaning(exc)
        if meaning is exc:
            raise
        raise meaning from exc
    except google.CredentialsError as exc:
        raise Refused(f"the Google credentials could not be used ({exc})") from exc
    except RefreshError as exc:
        if exc.retryable:
            raise Unavailable(f"Google sign-in failed for now: {exc}") from exc
        raise Refused(f"Google refused the credentials: {exc}") from exc
    except google.transport_errors() as exc:
        raise Unavailable(f"Gmail could not be reached: {exc}") from exc
    return {"message_id": sent["id"], "thread_id": sent.get("threadId") or "", "to": draft["to"]}


def _meaning(exc: HttpError) -> Exception:
    """What an API error means: refused, retry (rate limit), or as it is (429/5xx: the engine retries)."""
    status = google.status_of(exc)
    if status == 403 and _reasons(exc) & RATE_LIMIT_REASONS:
        return Unavailable(f"Gmail rate limit: {google.reason_of(exc)}")
    if status in REFUSED_STATUSES:
        return Refused(google.reason_of(exc))
    return exc


def _reasons(exc: HttpError) -> set[str]:
    try:
        return {e.get("reason", "") for e in json.loads(exc.content)["error"].get("errors", [])}
    except Exception:  # not JSON, or another shape
        return set()


__all__ = ["Refused", "Unavailable", "find_sent", "mime_message", "raw_of", "search_query", "send"]
