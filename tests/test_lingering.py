"""The linger-then-batch thread behind the task events and the delivered attempts (``tasks/worker/lingering.py``)."""
from __future__ import annotations

import os

from tasks.worker.lingering import LingeringThread, per_process


class _Flaky(LingeringThread):
    """Fails on the batches holding "boom"; keeps every other."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        super().__init__("flaky", 0.01, 10)

    def handle(self, batch: list[str]) -> None:
        if "boom" in batch:
            raise RuntimeError("a batch this thread could not handle")
        self.kept.extend(batch)


def test_a_batch_that_raises_is_logged_and_the_thread_goes_on(caplog):
    """A batch whose handling raises is logged and counted as not handled; the items put after it are
    still handled (the thread lives as long as its process)."""
    thread = _Flaky()
    thread.put("boom")
    assert thread.drain(5)
    thread.put("after")
    assert thread.drain(5), "the thread died with the batch that raised"
    assert thread.kept == ["after"] and thread.batches == 1 and thread.failed == 1
    assert "a batch this thread could not handle" in caplog.text


def test_per_process_makes_one_thread_and_tells_this_processs():
    made = per_process(_Flaky)
    assert made.here() is None  # none made yet in this process
    first = made()
    assert made() is first and made.here() is first and made.made == {os.getpid(): first}
