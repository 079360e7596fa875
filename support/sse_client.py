"""A Server-Sent Events client for the tests: reads ``GET /voice-tools/events/<session>`` over HTTP."""
from __future__ import annotations

import json
from typing import Any, Iterator

import requests


class Stream:
    """An open SSE connection: ``next_event()`` returns ``(id, data)``; comments are kept apart, each
    event's ``event:`` field in ``kinds`` (in order) and the last ``retry:`` hint in ``retry``."""

    def __init__(self, url: str, headers: dict[str, str]):
        """``headers`` carry the ``Authorization`` (and a ``Last-Event-ID`` to resume)."""
        self.response = requests.get(url, headers=headers, stream=True, timeout=(5, 20))
        self.comments: list[str] = []
        self.kinds: list[str | None] = []
        self.retry: int | None = None
        self._lines: Iterator[str] = self.response.iter_lines(decode_unicode=True)

    def next_event(self) -> tuple[str, dict[str, Any]]:
        event_id, kind, data = None, None, None
        for line in self._lines:
            if line.startswith(":"):
                self.comments.append(line)
            elif line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("retry: "):
                self.retry = int(line[7:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line == "" and data is not None:
                self.kinds.append(kind)
                return event_id, data
        raise AssertionError("stream ended")

    def close(self) -> None:
        self.response.close()
