"""The caller's task list, written by create_task.

Local (default): the ``todo_tasks`` table, one row per call (``tool_call_id`` unique,
``id`` derived from it), so a redelivered CREATING link finds the task it added; the row
belongs to the call's caller (``owner``). On Google, the caller's own credentials where
they are configured (``voice_tools_backends/google.py``).

Google (``settings.uses_google("tasks")``): the Tasks API's ``tasks.insert`` on the
list ``VOICE_TOOLS_GOOGLE_TASKLIST`` (default ``@default``, the user's default list;
scope ``tasks``). Google Tasks has no field for a priority and no client-chosen id,
so the notes start with ``Priority: <priority>`` and end with a marker line
``voice-tools:<tool_call_id>``; before inserting, the tasks of the list updated in
the last day (completed, hidden and deleted ones too) are searched for the marker,
and a task found is returned instead of inserting a second one. ``due`` is sent as
RFC 3339 midnight UTC (Google keeps only the date).

An insert whose answer was lost (408, 5xx, a timeout, a connection cut after the request went)
may have added the task: the list is asked for it again with backoff for
``VOICE_TOOLS_GOOGLE_CONFIRM_WAIT`` seconds; found, it is the result; not, :class:`Unconfirmed`.
Never a second insert: a list that answers without the task may lag behind by any time.

Errors: :class:`Refused` for 400, 401, 403, 404 (the task surely was not added);
a 429 goes through as it is (retried by the engine, which then looks before inserting);
:class:`Unavailable` for a connection that failed below HTTP.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from datetime import date, datetime, timedelta, timezone
from typing import Any, Iterator

from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import insert

from models import db, settings
from models.task_list import TodoTask
from voice_tools_backends import google
from voice_tools_backends import Refused, Unavailable, Unconfirmed

DEFAULT_TASKLIST = "@default"
REFUSED_STATUSES = frozenset({400, 401, 403, 404})
LOCK_SPACE = 0x7654  # this module's advisory locks (the first key of the pair)
UNKNOWN_STATUSES = frozenset({408, 500, 502, 503, 504})  # the insert may have been done
MARKER_PREFIX = "voice-tools:"
LOOKBACK = timedelta(days=1)
MAX_PAGES = 20  # 2,000 tasks updated in a day is more than any person's list




def tasklist() -> str:
    return settings.load().google_tasklist


def task_id_for(tool_call_id: str) -> str:
    return "task_" + hashlib.sha256(tool_call_id.encode()).hexdigest()[:24]


def marker_for(tool_call_id: str) -> str:
    return MARKER_PREFIX + tool_call_id


def create(tool_call_id: str, draft: dict[str, Any], caller: str = "", earlier_attempt: bool = False) -> dict[str, Any]:
    """Add the task of ``draft`` (``title``, ``notes``, ``due`` ISO date or None, ``priority``) once, to
    ``caller``'s list.

    Returns ``{task_id, title, due, priority, web_link}``; called again for the same
    ``tool_call_id`` it returns the task already added.
    """
    if settings.load().uses_google("tasks"):
        try:
            svc = google.service("tasks", "v1", caller=caller)
        except google.CredentialsError as exc:
            raise Refused(str(exc)) from exc
        return google_create(svc, tool_call_id, draft, tasklist(), earlier_attempt=earlier_attempt)
    return local_create(tool_call_id, draft, caller)


# -- local ------------------------------------------------------------------------------

def local_create(tool_call_id: str, draft: dict[str, Any], caller: str = "") -> dict[str, Any]:
    due = date.fromisoformat(draft["due"]) if draft.get("due") else None
    with db.session() as s:
        s.execute(
            insert(TodoTask)
            .values(id=task_id_for(tool_call_id), tool_call_id=tool_call_id, owner=caller or "", title=draft["title"],
                    notes=draft.get("notes") or "", due=due, priority=draft["priority"])
            .on_conflict_do_nothing(index_elements=["tool_call_id"])
        )
        row = s.scalars(select(TodoTask).where(TodoTask.tool_call_id == tool_call_id,
                                               TodoTask.owner == (caller or ""))).one()
        return {"task_id": row.id, "title": row.title, "due": row.due.isoformat() if row.due else None,
                "priority": row.priority, "web_link": None}


# -- Google Tasks API ---------------------------------------------------------------------

def google_notes(tool_call_id: str, draft: dict[str, Any]) -> str:
    """``Priority: high``, the caller's notes, and the marker as the last line."""
    parts = [f"Priority: {draft['priority']}"]
    if draft.get("notes"):
        parts.append(draft["notes"])
    parts.append(marker_for(tool_call_id))
    return "\n\n".join(parts)


def google_body(tool_call_id: str, draft: dict[str, Any]) -> dict[str, Any]:
    body = {"title": draft["title"], "notes": google_notes(tool_call_id, draft)}
    if draft.get("due"):
        body["due"] = f"{date.fromisoformat(draft['due']).isoformat()}T00:00:00.000Z"
    return body


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def find_marked(svc: Any, tool_call_id: str, tasklist_id: str, now: datetime | None = None) -> dict[str, Any] | None:
    """The task of the list whose notes carry this call's marker line, if one was added in the last day."""
    marker = marker_for(tool_call_id)
    since = _rfc3339((now or datetime.now(timezone.utc)) - LOOKBACK)
    tasks = svc.tasks()
    request = tasks.list(tasklist=tasklist_id, showCompleted=True, showHidden=True, showDeleted=True,
                         maxResults=100, updatedMin=since)
    for _ in range(MAX_PAGES):
        if request is None:
            break
        page = request.execute()
        for task in page.get("items") or []:
            if marker in (task.get("notes") or "").splitlines():
                return task
        request = tasks.list_next(request, page)
    return None


def _result(task: dict[str, Any], draft: dict[str, Any]) -> dict[str, Any]:
    return {"task_id": task["id"], "title": task.get("title") or draft["title"], "due": draft.get("due"),
            "priority": draft["priority"], "web_link": task.get("webViewLink")}


def google_create(svc: Any, tool_call_id: str, draft: dict[str, Any], tasklist_id: str = DEFAULT_TASKLIST,
                  now: datetime | None = None, earlier_attempt: bool = False) -> dict[str, Any]:
    """Find this call's task by its marker, or ``tasks.insert`` it; never insert twice for a call.

    ``earlier_attempt`` (an earlier attempt may have inserted it): the list is asked again until
    the task shows or the bound passes (``VOICE_TOOLS_GOOGLE_CONFIRM_WAIT``), then
    :class:`Unconfirmed`, never a second insert. An insert whose answer leaves it unknown (a 5xx,
    a timeout) is looked for the same way, and ends the same way: found, or :class:`Unconfirmed`.
    A list that answers without the task is not taken for "not added": it may lag by any time.
    """
    with one_copy_at_a_time(tool_call_id) as another_went_first:
        return _create_once(svc, tool_call_id, draft, tasklist_id, now, earlier_attempt or another_went_first)


@contextmanager
def one_copy_at_a_time(tool_call_id: str) -> Iterator[bool]:
    """Hold this call's lock (a PostgreSQL advisory lock, for one transaction) while the task is looked
    for and inserted; yields True when another copy of the step held it first, which may have inserted it."""
    with db.session() as s:
        key = {"space": LOCK_SPACE, "call": tool_call_id}
        free = s.scalar(text("SELECT pg_try_advisory_xact_lock(:space, hashtext(:call))"), key)
        if not free:
            s.execute(text("SELECT pg_advisory_xact_lock(:space, hashtext(:call))"), key)
        yield not free


def _create_once(svc: Any, tool_call_id: str, draft: dict[str, Any], tasklist_id: str, now: datetime | None,
                 earlier_attempt: bool) -> dict[str, Any]:
    look = lambda: find_marked(svc, tool_call_id, tasklist_id, now)  # noqa: E731
    if earlier_attempt:
        found = google.within_bound(look)
        if found is None:
            raise Unconfirmed("Google Tasks did not show whether the task was added")
        return _result(found, draft)
    try:
        found = look()
        if found is not None:
            return _result(found, draft)
        try:
            created = svc.tasks().insert(tasklist=tasklist_id, body=google_body(tool_call_id, draft)).execute()
        except Exception as exc:
            unknown = (isinstance(exc, google.transport_errors() + (TimeoutError, OSError))
                       or google.status_of(exc) in UNKNOWN_STATUSES)
            if not unknown:
                raise
            found = google.within_bound(look)  # it may have been added: the list lags behind inserts
            if found is not None:
                return _result(found, draft)
            # a list that answered without it proves nothing (it may lag by any time): never insert again
            raise Unconfirmed("Google Tasks did not show whether the task was added") from exc
    except google.HttpError as exc:
        status = google.status_of(exc)
        if status == 404:
            raise Refused(f"the task list {tasklist_id} was not found") from exc
        if status in REFUSED_STATUSES:
            raise Refused(f"Google Tasks refused it ({google.reason_of(exc).rstrip('.')})") from exc
        raise
    except google.transport_errors() as exc:
        raise Unavailable(f"Google Tasks could not be reached ({type(exc).__name__})") from exc
    return _result(created, draft)
