"""What Celery did, seen through its own signals (the test worker runs in this process).

``TaskLog`` records every task message published (name, queue, eta, retries, args)
and every task run (name, final state) while it is open, so a test can show that a
chain's later links were never sent, that a retry was published with a delay, or
that no link ended in FAILURE. Celery publishes the next link of a chain before it
sends ``task_postrun`` for the current one, so once a link's run is recorded, the set
of messages it published is final.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from celery import signals


@dataclass(frozen=True)
class Published:
    name: str
    queue: str | None
    args: tuple[Any, ...]
    eta: str | None
    retries: int


@dataclass(frozen=True)
class Ran:
    name: str
    args: tuple[Any, ...]
    state: str | None
    retval: Any = None


class TaskLog:
    def __init__(self) -> None:
        self.published: list[Published] = []
        self.ran: list[Ran] = []
        self._cond = threading.Condition()

    # -- signal receivers ------------------------------------------------------------

    def _on_publish(self, sender: Any = None, body: Any = None, headers: Any = None,
                    routing_key: Any = None, **_: Any) -> None:
        headers = headers or {}
        args = tuple(body[0]) if isinstance(body, (tuple, list)) and body else ()
        item = Published(headers.get("task") or str(sender), routing_key, args, headers.get("eta"),
                         int(headers.get("retries") or 0))
        with self._cond:
            self.published.append(item)
            self._cond.notify_all()

    def _on_postrun(self, sender: Any = None, args: Any = None, state: Any = None, retval: Any = None,
                    **_: Any) -> None:
        with self._cond:
            self.ran.append(Ran(sender.name, tuple(args or ()), state, retval))
            self._cond.notify_all()

    def __enter__(self) -> "TaskLog":
        signals.before_task_publish.connect(self._on_publish, weak=False)
        signals.task_postrun.connect(self._on_postrun, weak=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        signals.before_task_publish.disconnect(self._on_publish)
        signals.task_postrun.disconnect(self._on_postrun)

    # -- queries -----------------------------------------------------------------------

    def published_for(self, tool_call_id: str, name: str | None = None) -> list[Published]:
        with self._cond:
            return [p for p in self.published
                    if p.args[:1] == (tool_call_id,) and (name is None or p.name == name)]

    def ran_for(self, tool_call_id: str, name: str | None = None) -> list[Ran]:
        with self._cond:
            return [r for r in self.ran if r.args[:1] == (tool_call_id,) and (name is None or r.name == name)]

    def wait_ran(self, tool_call_id: str | None, name: str, count: int = 1, timeout: float = 15.0) -> list[Ran]:
        """Block until task ``name`` has finished ``count`` times for the call (None: any arguments)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                runs = [r for r in self.ran
                        if r.name == name and (tool_call_id is None or r.args[:1] == (tool_call_id,))]
                if len(runs) >= count:
                    return runs
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(r.name, r.state) for r in self.ran if r.args[:1] == (tool_call_id,)]
                    raise AssertionError(f"{name} ran {len(runs)}/{count} times for {tool_call_id}; saw {seen}")
                self._cond.wait(left)
