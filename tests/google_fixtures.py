"""Google's APIs as a local HTTP double (see ``tests/http_double.py``).

``google_api`` configures the product as an operator would for Google (an
authorized-user credentials file, ``VOICE_TOOLS_GOOGLE_CREDENTIALS``) and points the
real google-api-python-client at the double (``VOICE_TOOLS_GOOGLE_API_ENDPOINT``).
The token in the file is valid for an hour, so no token refresh goes out.
``google_env(double, tmp_path)`` gives the same variables for a worker subprocess.
``GmailDouble``, ``TasksDouble`` and ``CalendarDouble`` keep state on such a double as the
services do (a sent draft is gone; a search that lags), for the exactly-once tests.
"""
from __future__ import annotations

import base64
import email
import email.policy
import json
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.http_double import HttpDouble, Reply


def google_env(double: HttpDouble, folder: Path, services: str = "gmail,calendar,people,tasks") -> dict[str, str]:
    expiry = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    creds = folder / "google-authorized-user.json"
    creds.write_text(json.dumps({
        "type": "authorized_user", "client_id": "test-client.apps.googleusercontent.com",
        "client_secret": "test-secret", "refresh_token": "test-refresh", "token": "test-access-token",
        "expiry": expiry,
    }))
    return {"VOICE_TOOLS_GOOGLE_CREDENTIALS": str(creds), "VOICE_TOOLS_GOOGLE_API_ENDPOINT": double.url + "/",
            "VOICE_TOOLS_GOOGLE_SERVICES": services}


@pytest.fixture
def google_api(tmp_path, monkeypatch):
    """A Google API double the product (API and in-process worker) is configured to use."""
    with HttpDouble() as double:
        for key, value in google_env(double, tmp_path).items():
            monkeypatch.setenv(key, value)
        yield double


# -- stateful doubles: Google's services as they keep what was asked ----------------------------

def google_error(status: int, message: str, reason: str) -> dict:
    return {"error": {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}}


class _Service:
    """What the stateful doubles share: a lock, ids, and scripted answers per operation.

    ``refuse[operation]``: statuses answered (one per request, in order) before the operation acts;
    ``after[operation]``: ``(status, hold_seconds)`` answered after it acted (a 503 whose send went
    through; a send that hangs once done). ``lag``: seconds before what was made shows in a search.
    """

    def __init__(self, api: HttpDouble, lag: float = 0.0) -> None:
        self.api, self.lag = api, lag
        self.refuse: dict[str, list[int]] = {}
        self.after: dict[str, list[tuple[int, float]]] = {}
        self._lock = threading.Lock()
        self._n = 0

    def _id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def _refused(self, operation: str) -> Reply | None:
        with self._lock:
            queue = self.refuse.get(operation) or []
            status = queue.pop(0) if queue else None
        if status is None:
            return None
        return Reply(status, google_error(status, f"Refused with {status}", "failedPrecondition"))

    def _after(self, operation: str, body: Any) -> Any:
        with self._lock:
            queue = self.after.get(operation) or []
            status, hold = queue.pop(0) if queue else (200, 0.0)
        if hold:
            time.sleep(hold)
        if status != 200:
            return Reply(status, google_error(status, "Backend Error", "backendError"))
        return body

    def _visible(self, made_at: float) -> bool:
        return time.monotonic() - made_at >= self.lag


class GmailDouble(_Service):
    """Gmail's drafts and sent mail: ``drafts.send`` sends a draft once and removes it (a second send of
    it answers 404), ``messages.list q=rfc822msgid:`` finds a sent message ``lag`` seconds after."""

    BASE = "/gmail/v1/users/me"

    def __init__(self, api: HttpDouble, lag: float = 0.0) -> None:
        super().__init__(api, lag)
        self.drafts: dict[str, dict[str, Any]] = {}  # draft id -> {raw, message_id, at}
        self.sent: list[dict[str, Any]] = []  # {id, threadId, raw, message_id, at}
        b = self.BASE
        api.answer("POST", rf"^{b}/drafts/send$", self._send, times=None)
        api.answer("POST", rf"^{b}/drafts$", self._create, times=None)
        api.answer("GET", rf"^{b}/drafts$", self._list_drafts, times=None)
        api.answer("GET", rf"^{b}/drafts/[^/]+$", self._get_draft, times=None)
        api.answer("PUT", rf"^{b}/drafts/[^/]+$", self._update, times=None)
        api.answer("DELETE", rf"^{b}/drafts/[^/]+$", self._delete_draft, times=None)
        api.answer("GET", rf"^{b}/messages$", self._search, times=None)
        api.answer("POST", rf"^{b}/messages/send$", self._send_raw, times=None)

    @staticmethod
    def message_id_of(raw: str) -> str:
        parsed = email.message_from_bytes(base64.urlsafe_b64decode(raw), policy=email.policy.default)
        return str(parsed["Message-ID"] or "")

    @staticmethod
    def _wanted(request: Any) -> str:
        q = (request.query.get("q") or [""])[0]
        assert q.startswith("rfc822msgid:"), q
        return q.split(":", 1)[1]

    def _draft_view(self, draft_id: str) -> dict[str, Any]:
        return {"id": draft_id, "message": {"id": "m" + draft_id, "threadId": "t" + draft_id, "labelIds": ["DRAFT"]}}

    def _create(self, request: Any) -> Any:
        refused = self._refused("create")
        if refused:
            return refused
        raw = request.json["message"]["raw"]
        with self._lock:
            draft_id = self._id("r-")
            self.drafts[draft_id] = {"raw": raw, "message_id": self.message_id_of(raw), "at": time.monotonic()}
        return self._after("create", self._draft_view(draft_id))

    def _update(self, request: Any) -> Any:
        draft_id = request.path.rsplit("/", 1)[1]
        raw = request.json["message"]["raw"]
        with self._lock:
            if draft_id not in self.drafts:
                return Reply(404, google_error(404, "Requested entity was not found.", "notFound"))
            self.drafts[draft_id].update(raw=raw, message_id=self.message_id_of(raw))
        return self._draft_view(draft_id)

    def _list_drafts(self, request: Any) -> Any:
        refused = self._refused("list_drafts")
        if refused:
            return refused
        wanted = self._wanted(request)
        with self._lock:
            found = [self._draft_view(i) for i, d in self.drafts.items()
                     if d["message_id"].strip("<>") == wanted and self._visible(d["at"])]
        return {"drafts": found, "resultSizeEstimate": len(found)} if found else {"resultSizeEstimate": 0}

    def _get_draft(self, request: Any) -> Any:
        refused = self._refused("get_draft")
        if refused:
            return refused
        draft_id = request.path.rsplit("/", 1)[1]
        with self._lock:
            if draft_id not in self.drafts:
                return Reply(404, google_error(404, "Requested entity was not found.", "notFound"))
        return self._draft_view(draft_id)

    def _delete_draft(self, request: Any) -> Any:
        draft_id = request.path.rsplit("/", 1)[1]
        with self._lock:
            if self.drafts.pop(draft_id, None) is None:
                return Reply(404, google_error(404, "Requested entity was not found.", "notFound"))
        return b""

    def _send(self, request: Any) -> Any:
        refused = self._refused("send")
        if refused:
            return refused
        draft_id = request.json["id"]
        with self._lock:
            draft = self.drafts.pop(draft_id, None)
            if draft is None:
                return Reply(404, google_error(404, "Requested entity was not found.", "notFound"))
            message = {"id": self._id("gm-msg-"), "threadId": self._id("gm-thr-"), "raw": draft["raw"],
                       "message_id": draft["message_id"], "at": time.monotonic()}
            self.sent.append(message)
        return self._after("send", {"id": message["id"], "threadId": message["threadId"], "labelIds": ["SENT"]})

    def _send_raw(self, request: Any) -> Any:
        """``messages.send``: every request sends (no idempotency at Gmail)."""
        refused = self._refused("send")
        if refused:
            return refused
        raw = request.json["raw"]
        with self._lock:
            message = {"id": self._id("gm-msg-"), "threadId": self._id("gm-thr-"), "raw": raw,
                       "message_id": self.message_id_of(raw), "at": time.monotonic()}
            self.sent.append(message)
        return self._after("send", {"id": message["id"], "threadId": message["threadId"], "labelIds": ["SENT"]})

    def _search(self, request: Any) -> Any:
        refused = self._refused("search")
        if refused:
            return refused
        wanted = self._wanted(request)
        with self._lock:
            found = [{"id": m["id"], "threadId": m["threadId"]} for m in self.sent
                     if m["message_id"].strip("<>") == wanted and self._visible(m["at"])]
        return {"messages": found, "resultSizeEstimate": len(found)} if found else {"resultSizeEstimate": 0}


class TasksDouble(_Service):
    """Google Tasks' lists: ``tasks.insert`` adds a task (no client id: twice is two tasks),
    ``tasks.list`` shows it ``lag`` seconds after."""

    PATH = r"^/tasks/v1/lists/[^/]+/tasks$"

    def __init__(self, api: HttpDouble, lag: float = 0.0) -> None:
        super().__init__(api, lag)
        self.tasks: list[dict[str, Any]] = []
        api.answer("POST", self.PATH, self._insert, times=None)
        api.answer("GET", self.PATH, self._list, times=None)

    def _insert(self, request: Any) -> Any:
        refused = self._refused("insert")
        if refused:
            return refused
        with self._lock:
            task = {**request.json, "id": self._id("G"), "updated": datetime.now(timezone.utc).isoformat(),
                    "webViewLink": "https://tasks.google.com/task/x", "status": "needsAction"}
            self.tasks.append({**task, "at": time.monotonic()})
        return self._after("insert", task)

    def _list(self, request: Any) -> Any:
        refused = self._refused("list")
        if refused:
            return refused
        with self._lock:
            items = [{k: v for k, v in t.items() if k != "at"} for t in self.tasks if self._visible(t["at"])]
        return {"items": items}


class CalendarDouble(_Service):
    """Google Calendar's events: ``events.insert`` with a client id answers 409 when that id exists,
    ``events.get`` reads one back ``lag`` seconds after it was made; ``freebusy.query`` answers free."""

    def __init__(self, api: HttpDouble, calendar: str = "primary", lag: float = 0.0) -> None:
        super().__init__(api, lag)
        self.events: dict[str, dict[str, Any]] = {}
        self._made: dict[str, float] = {}
        self.calendar = calendar
        api.answer("POST", r"/freeBusy$", {"calendars": {calendar: {"busy": []}}}, times=None)
        api.answer("POST", rf"/calendars/{calendar}/events$", self._insert, times=None)
        api.answer("GET", rf"/calendars/{calendar}/events/[^/]+$", self._get, times=None)

    def _insert(self, request: Any) -> Any:
        refused = self._refused("insert")
        if refused:
            return refused
        body = request.json
        with self._lock:
            if body["id"] in self.events:
                return Reply(409, google_error(409, "The requested identifier already exists.", "duplicate"))
            event = {**body, "status": "confirmed", "htmlLink": f"https://calendar.google.com/event?eid={body['id']}"}
            self.events[body["id"]] = event
            self._made[body["id"]] = time.monotonic()
        return self._after("insert", event)

    def _get(self, request: Any) -> Any:
        refused = self._refused("get")
        if refused:
            return refused
        event_id = request.path.rsplit("/", 1)[1]
        with self._lock:
            event = self.events.get(event_id)
            if event is not None and not self._visible(self._made.get(event_id, 0.0)):
                event = None
        if event is None:
            return Reply(404, google_error(404, "Not Found", "notFound"))
        return event
