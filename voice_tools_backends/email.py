"""Sending email: the local outbox (default; one row per call, never two, its ``owner`` the call's caller).

The message id is derived from the tool_call_id, so a redelivered SENDING link finds
the message it already sent instead of sending it again.
"""
from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert

from models import db, settings
from models.email import EmailOutbox


def message_id_for(tool_call_id: str) -> str:
    """The call's fixed ``Message-ID``, namespaced by the deployment (``VOICE_TOOLS_DEPLOYMENT``)."""
    return f"<{tool_call_id}@{settings.load().deployment}.voice-tools.local>"


def thread_id_for(tool_call_id: str) -> str:
    return "thr_" + hashlib.sha256(tool_call_id.encode()).hexdigest()[:16]


def send(tool_call_id: str, draft: dict[str, Any], caller: str = "") -> dict[str, Any]:
    """Put ``caller``'s message in the outbox once; return ``{message_id, thread_id, to}``."""
    headers = {
        "To": draft["to"],
        "Cc": ", ".join(draft.get("cc") or []),
        "Subject": draft["subject"],
        "Message-ID": draft["message_id"],
    }
    with db.session() as s:
        s.execute(
            insert(EmailOutbox)
            .values(
                tool_call_id=tool_call_id,
                owner=caller or "",
                message_id=draft["message_id"],
                thread_id=thread_id_for(tool_call_id),
                headers=headers,
                body=draft.get("body") or "",
            )
            .on_conflict_do_nothing(index_elements=["tool_call_id"])
        )
        row = s.scalars(select(EmailOutbox).where(EmailOutbox.tool_call_id == tool_call_id,
                                                  EmailOutbox.owner == (caller or ""))).one()
        return {"message_id": row.message_id, "thread_id": row.thread_id, "to": row.headers["To"]}
