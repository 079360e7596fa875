"""Two tools for the worker-metrics test, loaded into a real prefork worker by
``--include tests.metered_tools`` and imported by the test that enqueues their calls.

``metered_ok`` looks something up and completes; ``metered_flaky`` meets a transient
error at every try, is retried once, then fails; ``metered_once`` meets one at its first
try (``what`` names a file that does not exist yet: the try makes it), then completes.
"""
from __future__ import annotations

from pathlib import Path

from marshmallow import Schema, fields

from tasks import chains
from tasks.tools import Step, Tool, TransientError


class Thing(Schema):
    what = fields.String(required=True)


def look_up(step):
    return {"found": step.parameters["what"]}


def always_busy(step):
    raise TransientError("the service is busy")


def busy_once(step):
    marker = Path(step.parameters["what"])
    if not marker.exists():
        marker.touch()
        raise TransientError("the service is busy this once")
    return {"found": marker.name}


def _tool(name: str, step: Step) -> Tool:
    return Tool(
        name=name, description="A tool the metrics test runs.", schema=Thing, action_level="read",
        steps=(step, Step("COMPLETED")), result=lambda outputs: dict(outputs),
        confirmation_message="Look up {what}?", start_message="Looking up {what}.", modified_message="Now {what}?",
        voice_response="Found {what}.", failure_response="The {what} lookup failed: {error}.",
        cancelled_response="Cancelled.", max_retries=1,
    )


METERED_OK = _tool("metered_ok", Step("FETCH", run=look_up, message="Fetched {what}."))
METERED_FLAKY = _tool("metered_flaky", Step("TRY", run=always_busy))
METERED_ONCE = _tool("metered_once", Step("TRY", run=busy_once, message="Tried {what}."))
TOOLS = (METERED_OK, METERED_FLAKY, METERED_ONCE)

for _tool_ in TOOLS:
    chains.register_tool(_tool_)
