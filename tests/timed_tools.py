"""Two tools whose steps outlast their soft time limit of one second.

Loaded into a real prefork worker by ``--include tests.timed_tools`` (time limits
need the prefork pool: the in-process test worker runs threads) and imported by the
test that enqueues their calls. ``timed_read`` hangs in an ordinary step;
``timed_write`` hangs in its side effect, past the point of no return;
``timed_stubborn`` swallows the soft limit, so the hard one (11 s) kills the child.
"""
from __future__ import annotations

import time

from marshmallow import Schema, fields

from tasks import chains
from tasks.tools import Step, Tool

HANG_S = 30  # far past the soft limit (1 s); the hard limit (11 s) is never reached


class Thing(Schema):
    what = fields.String(required=True)


def hang(step):
    time.sleep(HANG_S)
    return {"never": True}


def hang_through_soft_limit(step):
    """As client code that catches ``Exception`` does: the soft limit is swallowed."""
    try:
        time.sleep(HANG_S)
    except Exception:
        time.sleep(HANG_S)
    return {"never": True}


def _tool(name: str, step: Step, max_retries: int) -> Tool:
    return Tool(
        name=name, description="A tool whose step outlasts its time limit.", schema=Thing, action_level="write",
        steps=(step, Step("COMPLETED")), result=lambda outputs: dict(outputs),
        confirmation_message="Do {what}?", start_message="Doing {what}.", modified_message="Now {what}?",
        voice_response="Did {what}.", failure_response="The {what} did not happen: {error}.",
        cancelled_response="Cancelled.", time_limit=1, max_retries=max_retries,
    )


TIMED_READ = _tool("timed_read", Step("FETCH", run=hang), max_retries=1)
TIMED_WRITE = _tool("timed_write", Step("APPLY", run=hang, side_effect=True), max_retries=0)
TIMED_STUBBORN = _tool("timed_stubborn", Step("FETCH", run=hang_through_soft_limit), max_retries=1)
TOOLS = (TIMED_READ, TIMED_WRITE, TIMED_STUBBORN)

for _tool_ in TOOLS:
    chains.register_tool(_tool_)
