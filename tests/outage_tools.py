"""A tool whose one step the test drives through files, for a worker in another process.

Loaded into a real worker by ``--include tests.outage_tools`` and imported by the test
that records its calls. The folder is ``VOICE_TOOLS_TEST_STEP_DIR``: each run of the step
appends a line to ``runs``, waits for ``release`` to exist, then fails transiently while
``outage`` exists and succeeds once it is gone.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from marshmallow import Schema, fields

from tasks import chains
from tasks.tools import Step, Tool, TransientError

STEP_DIR = "VOICE_TOOLS_TEST_STEP_DIR"


class Thing(Schema):
    what = fields.String(required=True)


def fetch(step):
    folder = Path(os.environ[STEP_DIR])
    with open(folder / "runs", "a") as runs:
        runs.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + 60
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if (folder / "outage").exists():
        raise TransientError("HTTP 503 from the service")
    return {"fetched": True}


OUTAGE_READ = Tool(
    name="outage_read", description="A read whose service fails while the test says so.", schema=Thing,
    action_level="read", steps=(Step("FETCH", run=fetch), Step("COMPLETED")), result=lambda outputs: dict(outputs),
    confirmation_message="Look up {what}?", start_message="Looking up {what}.", modified_message="Now {what}?",
    voice_response="Found {what}.", failure_response="The {what} lookup did not happen: {error}.",
    cancelled_response="Cancelled.", time_limit=90, max_retries=5,
)

chains.register_tool(OUTAGE_READ)
