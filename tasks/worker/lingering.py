"""A thread of the process that handles what it is given in batches: it waits a moment after the first
item of a batch, so that the items of the next moments join it.

Used where one round trip per item would cost a link (and the loop that dispatches links) far more than
one per batch: Celery's task events (``tasks/worker/task_events.py``: one Redis pipeline per batch) and
the links' delivered callback attempts (``tasks/delivery/delivered.py``: one statement per batch). A
subclass says what a batch is handled with (:meth:`LingeringThread.handle`); items keep their order.
One per process: a forked child makes its own (:func:`per_process`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)


class LingeringThread:
    """Takes items from :meth:`put`; once one arrives, waits ``linger_s`` and hands what has queued
    (at most ``batch`` items) to :meth:`handle`. Past ``backlog`` queued items the oldest are dropped
    (counted in ``dropped``; None: never). A batch whose handling raises is logged and counted in
    ``failed``; the thread goes on with the next."""

    def __init__(self, name: str, linger_s: float, batch: int, backlog: int | None = None) -> None:
        self.linger_s, self.batch = linger_s, batch
        self.queue: deque[Any] = deque(maxlen=backlog)
        self.ready = threading.Condition()
        self.busy = False  # a batch is being handled
        self.dropped = 0
        self.batches = 0  # batches handled
        self.failed = 0  # batches whose handling raised
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def handle(self, batch: list[Any]) -> None:
        """Handle one batch (a subclass's); what it can retry or give up on, it does
        itself; an error it raises is logged here, and that batch is not handled again."""
        raise NotImplementedError

    def put(self, item: Any) -> None:
        with self.ready:
            if len(self.queue) == self.queue.maxlen:
                self.dropped += 1
            self.queue.append(item)
            self.ready.notify()

    def drain(self, timeout: float) -> bool:
        """Wait until every item put is handled (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        with self.ready:
            while self.queue or self.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.ready.wait(min(left, 0.05))
        return True

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                self.busy = True
            time.sleep(self.linger_s)  # the items of the next moments join this one's batch
            with self.ready:
                batch = [self.queue.popleft() for _ in range(min(len(self.queue), self.batch))]
            try:
                self.handle(batch)
                self.batches += 1
            except Exception:  # the thread must outlive a batch: it is the process's only one
                self.failed += 1
                log.exception("%s: a batch of %d not handled", self.thread.name, len(batch))
            finally:
                with self.ready:
                    self.busy = False
                    self.ready.notify_all()


T = TypeVar("T", bound=LingeringThread)


def per_process(make: Callable[..., T]) -> Callable[..., T]:
    """A function returning this process's thread, made by ``make`` with the arguments of its first call
    (a forked child, which has no thread of its parent's, makes its own)."""
    made: dict[int, T] = {}
    lock = threading.Lock()

    def get(*args: Any) -> T:
        pid = os.getpid()
        found = made.get(pid)
        if found is None:
            with lock:
                found = made.get(pid)
                if found is None:
                    made.clear()  # a parent's, inherited by this forked child: its thread is not here
                    found = made[pid] = make(*args)
        return found

    get.made = made  # type: ignore[attr-defined]  # {this process's pid: its thread}, once made
    get.here = lambda: made.get(os.getpid())  # type: ignore[attr-defined]  # this process's thread, or None
    return get
