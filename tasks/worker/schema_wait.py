"""A worker consumes nothing until the database's schema is one this release runs on.

A worker bootstep started before the consumer (Celery starts its ``Consumer`` step last): on a schema
older than this release needs (``models/schema.py``) it logs one line (the revision found, the one
needed, the command that migrates) and waits, reading the schema again every two seconds, so no
message is taken that this release's statements could not run; once migrated it goes on and the
consumer starts. A warm or cold shutdown meanwhile stops the worker at once. Beat waits the same way
before it sends anything. A database that does
not answer is not waited for here (the links retry their statements, as ever).
"""
from __future__ import annotations

import time
from typing import Any

from celery import bootsteps
from celery.signals import beat_init
from celery.worker import state

from models import schema

POLL_S = 0.2


class SchemaWait(bootsteps.StartStopStep):
    label = "Schema"
    requires = ("celery.worker.components:Pool",)

    def start(self, worker: Any) -> None:
        wait_for_schema()


def wait_for_schema(gate: schema.Gate = schema.GATE) -> None:
    while True:
        try:
            if gate.verdict() is None:
                return
        except Exception:  # the database does not answer: the links' own retries are for that
            return
        deadline = time.monotonic() + gate.every_s
        while time.monotonic() < deadline:
            state.maybe_shutdown()  # a warm or cold shutdown asked meanwhile: Celery's own exception
            time.sleep(POLL_S)


def install(app: Any) -> None:
    app.steps["worker"].add(SchemaWait)
    beat_init.connect(_beat_waits, weak=False)


def _beat_waits(**_: Any) -> None:
    """``celery -A tasks beat`` sends nothing until the schema is one this release runs on (its sweeps
    would be run by workers of this release's tasks)."""
    wait_for_schema()
