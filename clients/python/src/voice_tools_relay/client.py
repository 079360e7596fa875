"""The REST calls and the event stream of voice-tools, for a relay."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator, Optional

import requests

RETRY_STATUSES = (429, 503)


class RelayError(Exception):
    """An answer that is not a success: the server's JSON ``error``, ``message`` and ``details``
    (``status`` is the HTTP status, ``retry_after`` its ``Retry-After`` in seconds when given)."""

    def __init__(self, status: int, error: str, message: str, details: Optional[dict] = None,
                 retry_after: Optional[float] = None):
        super().__init__(f"{status} {error}: {message}")
        self.status, self.error, self.message = status, error, message
        self.details = details or {}
        self.retry_after = retry_after


class Event(dict):
    """One event of the stream: the callback body (``tool_call_id``, ``seq``, ``step``, ``voice_response``, …)
    with its ``id`` (the ``id:`` line, = ``event_id``) and ``kind`` (the ``event:`` line: ``progress``,
    ``checkpoint``, ``completed``, ``failed``, ``cancelled`` or ``expired``)."""

    def __init__(self, event_id: str, kind: str, data: dict[str, Any]):
        super().__init__(data)
        self.id, self.kind = event_id, kind


class Client:
    """``Client(base_url, token)``: every method answers the server's JSON as a dict, or raises
    :class:`RelayError`. A 503 or a 429 is retried up to ``retries`` times (after its ``Retry-After``,
    at most ``max_wait`` seconds; without one, 0.5 s, 1 s, 2 s, …); ``pending`` and ``execute`` carry an
    idempotency key (made when not given), so a retried request never makes a second call."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 40.0, retries: int = 3,
                 max_wait: float = 30.0, session: Optional[requests.Session] = None):
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries, self.max_wait = timeout, retries, max_wait
        self.http = session or requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    # --- REST ---------------------------------------------------------------------------------

    def pending(self, session_id: str, function: str, parameters: dict[str, Any], *,
                idempotency_key: Optional[str] = None, **extra: Any) -> dict[str, Any]:
        """Record a call (PENDING). ``extra``: ``tool_call_id``, ``connection_id``, ``intent_id``,
        ``callback_url``, ``callback_urls``."""
        body = {"session_id": session_id, "function": function, "parameters": parameters, **extra}
        return self._call("POST", "/voice-tools/pending", json_body=body, key=idempotency_key or _new_key())

    def execute(self, session_id: str, function: str, parameters: dict[str, Any], *, wait: Optional[float] = None,
                idempotency_key: Optional[str] = None, **extra: Any) -> dict[str, Any]:
        """Record and start at once a call the caller already confirmed."""
        body = {"session_id": session_id, "function": function, "parameters": parameters, **extra}
        return self._call("POST", "/voice-tools/execute", json_body=body, wait=wait,
                          key=idempotency_key or _new_key())

    def modify(self, tool_call_id: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """Correct a PENDING call's parameters (merged into the stored ones; None removes a field)."""
        return self._call("PATCH", f"/voice-tools/modify/{tool_call_id}", json_body={"parameters": parameters})

    def confirm(self, tool_call_id: str, wait: Optional[float] = None, **extra: Any) -> dict[str, Any]:
        """Start a PENDING call. With ``wait`` (seconds, up to 30) the answer is the whole record as
        soon as the call reaches its checkpoint (PREPARED) or ends. ``extra``: ``callback_url(s)``."""
        return self._call("POST", f"/voice-tools/confirm/{tool_call_id}", json_body=extra or None, wait=wait)

    def resume(self, tool_call_id: str, action: str = "proceed", *, reason: Optional[str] = None,
               wait: Optional[float] = None) -> dict[str, Any]:
        """Answer a checkpoint: ``action`` is ``proceed`` or ``cancel``."""
        body: dict[str, Any] = {"action": action}
        if reason is not None:
            body["reason"] = reason
        return self._call("POST", f"/voice-tools/resume/{tool_call_id}", json_body=body, wait=wait)

    def cancel(self, tool_call_id: str, reason: Optional[str] = None) -> dict[str, Any]:
        """Cancel a call before its point of no return (409 ``too_late`` after it)."""
        return self._call("DELETE", f"/voice-tools/cancel/{tool_call_id}",
                          json_body={"reason": reason} if reason is not None else None)

    def status(self, tool_call_id: str) -> dict[str, Any]:
        """The call's whole record."""
        return self._call("GET", f"/voice-tools/status/{tool_call_id}")

    def context(self, session_id: str, limit: Optional[int] = None) -> dict[str, Any]:
        """The session's open calls and its last finished ones."""
        return self._call("GET", f"/voice-tools/context/{session_id}",
                          params={"limit": limit} if limit is not None else None)

    def tools(self, format: str = "realtime") -> dict[str, Any]:
        """The tools as OpenAI function definitions (``realtime`` or ``chat``)."""
        return self._call("GET", "/voice-tools/tools", params={"format": format})

    def _call(self, method: str, path: str, *, json_body: Any = None, params: Optional[dict] = None,
              wait: Optional[float] = None, key: Optional[str] = None) -> dict[str, Any]:
        params = dict(params or {})
        if wait is not None:
            params["wait"] = wait
        headers = {"Idempotency-Key": key} if key else {}
        attempt = 0
        while True:
            try:
                answer = self.http.request(method, self.base_url + path, json=json_body, params=params or None,
                                           headers=headers, timeout=self.timeout)
            except requests.ConnectionError:
                # no answer: safe to send again only when a replay cannot do it twice
                if not (method == "GET" or key) or attempt >= self.retries:
                    raise
                time.sleep(0.5 * 2 ** attempt)
                attempt += 1
                continue
            if answer.status_code < 400:
                return answer.json()
            error = _error(answer)
            if answer.status_code not in RETRY_STATUSES or attempt >= self.retries:
                raise error
            pause = error.retry_after if error.retry_after is not None else 0.5 * 2 ** attempt
            time.sleep(min(pause, self.max_wait))
            attempt += 1

    # --- the event stream -----------------------------------------------------------------------

    def follow(self, session_id: str, last_event_id: Optional[str] = None, *,
               read_timeout: float = 45.0) -> Iterator[Event]:
        """The session's events (its past ones first, or those after ``last_event_id``), then new ones
        as they happen, for as long as the caller iterates. A dropped connection (or one silent past
        ``read_timeout``: the server sends a keep-alive every 15 s) is opened again after the server's
        ``retry:`` hint with ``Last-Event-ID``, so no event is lost or repeated. An error answer
        (401, 404, 422 …) raises :class:`RelayError`; 429 and 503 are retried like the REST calls."""
        url = f"{self.base_url}/voice-tools/events/{session_id}"
        retry_s = 2.0
        refused = 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_event_id:
                headers["Last-Event-ID"] = last_event_id
            try:
                response = self.http.get(url, headers=headers, stream=True, timeout=(10, read_timeout))
            except requests.ConnectionError:
                time.sleep(retry_s)
                continue
            with response:
                if response.status_code != 200:
                    error = _error(response)
                    if response.status_code not in RETRY_STATUSES or refused >= self.retries:
                        raise error
                    refused += 1
                    pause = error.retry_after if error.retry_after is not None else retry_s
                    time.sleep(min(pause, self.max_wait))
                    continue
                refused = 0
                if response.encoding is None:
                    response.encoding = "utf-8"
                event_id, kind, data = None, None, []
                try:
                    for line in response.iter_lines(decode_unicode=True):
                        if line == "":
                            if data:
                                event = Event(event_id, kind or "message", json.loads("\n".join(data)))
                                last_event_id = event_id or last_event_id
                                yield event
                            event_id, kind, data = None, None, []
                        elif line.startswith(":"):
                            continue
                        else:
                            field, _, value = line.partition(":")
                            value = value[1:] if value.startswith(" ") else value
                            if field == "id":
                                event_id = value
                            elif field == "event":
                                kind = value
                            elif field == "data":
                                data.append(value)
                            elif field == "retry" and value.isdigit():
                                retry_s = int(value) / 1000
                except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
                        requests.Timeout):
                    pass  # dropped: open it again after the last event seen
            time.sleep(retry_s)


def _new_key() -> str:
    return uuid.uuid4().hex


def _error(answer: requests.Response) -> RelayError:
    try:
        body = answer.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    retry_after = answer.headers.get("Retry-After")
    try:
        seconds = float(retry_after) if retry_after is not None else None
    except ValueError:
        seconds = None
    return RelayError(answer.status_code, body.get("error", "http_error"),
                      body.get("message", answer.reason or ""), body.get("details"), seconds)
