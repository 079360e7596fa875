"""Sending email through Gmail, never twice for one call: a draft made before the checkpoint, sent once.

Chosen by the send_email tool when ``settings.load().uses_google("gmail")``; the local
outbox (``voice_tools_backends/email.py``) is the default.

The message carries a ``Message-ID`` fixed from the tool_call_id and the deployment
(``email.message_id_for``). PREPARING makes it a Gmail draft (:func:`prepare`:
``users.drafts.create``, or ``users.drafts.update`` of the draft a redelivered PREPARING
finds by that Message-ID) and records the draft's id in its output, before the
checkpoint. SENDING sends that draft (:func:`send`: ``users.drafts.send``), which Gmail
does once: a sent draft is gone, and sending it again is answered 404. So a second copy
of the link, a retry after a 5xx whose send went through, or a redelivery after a worker
died mid-send cannot send a second email; it finds the message sent
(``users.messages.list q=rfc822msgid:...``), asking again with backoff for
``VOICE_TOOLS_GOOGLE_CONFIRM_WAIT`` seconds (Gmail's search lags), and returns it. Not
found by then: :class:`Unconfirmed` (it may have gone; never "not sent").

A refusal of the send (400, 401, 403, 404) means "not sent" only when nothing earlier can
have sent it: no earlier attempt (``earlier_attempt``) and the draft still in the
mailbox (``users.drafts.get``). Scopes: ``gmail.compose`` (drafts) and ``gmail.readonly``
(the search; ``gmail.metadata`` does not allow ``q``); see ``voice_tools_backends.google.SCOPES``.
A call cancelled or expired at its checkpoint leaves its draft in the user's Drafts; once the
draft is sent, any other draft with its Message-ID (two PREPARING copies at once) is deleted.

Errors: :class:`Refused` when Google refused the request and nothing was sent;
:class:`Unavailable` for a 403 rate limit or a transport failure: worth retrying. 429 and
5xx ``HttpError``\\ s, timeouts and connection errors go through as they are (the engine
retries them).
"""
from __future__ import annotations

import base64
import json
from email.message import EmailMessage
from email.policy import SMTP
from typing import Any, Callable, TypeVar

from google.auth.exceptions import RefreshError

from voice_tools_backends import google
from voice_tools_backends.google import HttpError
from voice_tools_backends import Refused, Unavailable, Unconfirmed

USER = "me"
REFUSED_STATUSES = frozenset({400, 401, 403, 404})
RATE_LIMIT_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
POLICY = SMTP.clone(cte_type="7bit")  # CRLF lines; a non-ASCII body goes quoted-printable or base64
T = TypeVar("T")


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


def find_draft(service: Any, message_id: str) -> str | None:
    """The id of the draft with this Message-ID, or None."""
    found = service.users().drafts().list(userId=USER, q=search_query(message_id)).execute()
    drafts = found.get("drafts") or []
    return drafts[0]["id"] if drafts else None


def prepare(draft: dict[str, Any], service: Any = None) -> str:
    """Make ``draft`` this call's Gmail draft (the one with its Message-ID, updated, or a new one); its id."""
    def make() -> str:
        svc = service or google.service("gmail", "v1")
        body = {"message": {"raw": raw_of(draft)}}
        found = find_draft(svc, draft["message_id"])
        if found is not None:  # a redelivered PREPARING, or a modified call: the same draft, its new text
            return svc.users().drafts().update(userId=USER, id=found, body={"id": found, **body}).execute()["id"]
        return svc.users().drafts().create(userId=USER, body=body).execute()["id"]

    return _translated(make)


def send(tool_call_id: str, draft: dict[str, Any], service: Any = None,
         earlier_attempt: bool = False) -> dict[str, Any]:
    """Send the call's draft once; return ``{message_id, thread_id, to}`` (``message_id``: Gmail's message id).

    ``draft`` is PREPARING's output (``gmail_draft_id``: the draft :func:`prepare` made; a call
    prepared without one has it made now). ``earlier_attempt``: an earlier attempt of the send may
    have acted. ``service`` (a ``gmail`` v1 client) defaults to this thread's client.
    """
    def attempt() -> dict[str, Any]:
        svc = service or google.service("gmail", "v1")
        draft_id = draft.get("gmail_draft_id") or prepare(draft, svc)
        try:
            sent = svc.users().drafts().send(userId=USER, body={"id": draft_id}).execute()
        except HttpError as exc:
            if google.status_of(exc) not in REFUSED_STATUSES or _reasons(exc) & RATE_LIMIT_REASONS:
                raise  # a 5xx, 429 or rate limit: retried, and the retry's send finds the draft gone if it went
            if not earlier_attempt and _draft_present(svc, draft_id):
                raise  # refused, and the draft is still there: nothing was sent
            return _confirm_sent(svc, draft, exc)
        _remove_strays(svc, draft["message_id"])
        return sent

    sent = _translated(attempt)
    return {"message_id": sent["id"], "thread_id": sent.get("threadId") or "", "to": draft["to"]}


def _remove_strays(service: Any, message_id: str) -> None:
    """Delete the drafts left with this call's Message-ID once its draft is sent (two PREPARING copies
    at once, whose look-up had not shown the other's draft yet, each made one); best effort."""
    try:
        found = service.users().drafts().list(userId=USER, q=search_query(message_id)).execute()
        for stray in found.get("drafts") or []:
            service.users().drafts().delete(userId=USER, id=stray["id"]).execute()
    except (HttpError, *google.transport_errors()):
        pass  # a stray draft stays in the user's Drafts, where it harms nothing


def _draft_present(service: Any, draft_id: str) -> bool:
    """Is the draft still in the mailbox? False when it is gone or when Gmail will not say."""
    try:
        service.users().drafts().get(userId=USER, id=draft_id, format="minimal").execute()
        return True
    except HttpError:
        return False


def _confirm_sent(service: Any, draft: dict[str, Any], refusal: HttpError) -> dict[str, Any]:
    """The message an earlier send made, looked for until the bound; Unconfirmed when not found."""
    found = google.within_bound(lambda: find_sent(service, draft["message_id"]))
    if found is None:
        raise Unconfirmed(f"Gmail did not show whether the email went out ({google.reason_of(refusal).rstrip('.')})")
    return found


def _translated(work: Callable[[], T]) -> T:
    """Run ``work``, turning Google's answers into what they mean for the engine."""
    try:
        return work()
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


__all__ = ["Refused", "Unavailable", "Unconfirmed", "find_draft", "find_sent", "mime_message", "prepare", "raw_of",
           "search_query", "send"]
