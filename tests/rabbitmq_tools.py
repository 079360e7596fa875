"""A tool whose first step fails twice with a transient error, for ``tests/rabbitmq_cases.py``.

Loaded into a real worker by ``--include tests.rabbitmq_tools`` so that its queue is
one of the worker's own when it starts (declared as a quorum queue and bound to the
delay exchanges of native delayed delivery), and imported by the test that enqueues its
call. The step counts its tries by the call's ``attempts`` (on the database: a step without
side effect is counted when a run of it fails, not at its gate, so this try is one more than
the attempts so far): tries 1 and 2 fail, try 3 answers. Each message of the tool published
in the worker is logged (Celery's ``before_task_publish``) with the exchange and routing
key it went to, so the test can read where the retries went.
"""
from __future__ import annotations

import logging

from celery import signals
from marshmallow import Schema, fields
from sqlalchemy import select

from models import db
from models.calls import ToolCall
from tasks import chains
from tasks.tools import Step, StepInput, Tool, TransientError


class Thing(Schema):
    what = fields.String(required=True)


def fails_twice(step: StepInput) -> dict:
    with db.session() as s:  # a read step's gate counts nothing: the call's attempts are its failed runs so far
        tries = 1 + s.scalar(select(ToolCall.attempts).where(ToolCall.tool_call_id == step.tool_call_id))
    if tries <= 2:
        raise TransientError(f"HTTP 503 on try {tries}")
    return {"tries": tries}


FLAKY = Tool(
    name="rabbit_flaky", description="A tool whose step fails twice, then answers.", schema=Thing,
    action_level="read", steps=(Step("FETCH", run=fails_twice), Step("COMPLETED")),
    result=lambda outputs: dict(outputs),
    confirmation_message="Do {what}?", start_message="Doing {what}.", modified_message="Now {what}?",
    voice_response="Did {what}.", failure_response="The {what} did not happen: {error}.",
    cancelled_response="Cancelled.", max_retries=3, time_limit=20,
)

chains.register_tool(FLAKY)

log = logging.getLogger(__name__)


@signals.before_task_publish.connect(weak=False)
def _say_where_it_went(sender=None, headers=None, exchange=None, routing_key=None, **_):
    if str(sender).startswith(f"tools.{FLAKY.name}."):
        log.warning("published %s retries=%s exchange=%s routing_key=%s", sender, (headers or {}).get("retries"),
                    getattr(exchange, "name", exchange), routing_key)
