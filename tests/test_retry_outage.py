"""A retry the broker cannot take (issue 14 item 6; CONTRACT sections 6 and 7).

A link whose step fails transiently asks Celery to retry it: ``Task.retry`` publishes
a new message (with a countdown) and the running one is then acknowledged. When that
publish fails (the broker is down for the publishing side), Celery's own answer is
``Reject(requeue=False)``: the message is dropped, the chain is gone and the call sat
EXECUTING until the stuck-call sweep failed it as "worker stopped". The link now
hands its message back to the broker instead (``Reject(requeue=True)``), so the link
is delivered again and runs again once the broker takes publishes again.

How the outage is made: the in-process test worker keeps its consumer connection to
the real Redis (deliveries, acknowledgements and requeues go on), while the app's
producers are pointed at a closed port (``tests.api_fixtures.BrokerDown``): every
publish, the retry's included, fails as it does with the broker gone.
"""
from __future__ import annotations

import threading

from tasks import app, chains
from tasks.tools import Step, TransientError
from tests.api_fixtures import BrokerDown
from tests.helpers import make_call, row
from tests.test_chains import history, make_tool, register, task_log  # noqa: F401  (fixtures)


class FlakyDuringOutage:
    """A step that fails transiently while ``outage`` is set; its first run waits for the test."""

    def __init__(self) -> None:
        self.outage, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()
        self.runs = 0
        self.ran = threading.Condition()

    def __call__(self, step):
        with self.ran:
            self.runs += 1
            self.ran.notify_all()
        self.entered.set()
        assert self.release.wait(15), "the test never let the step go on"
        if self.outage.is_set():
            raise TransientError("HTTP 503 from the service")
        return {"fetched": True}

    def wait_runs(self, count: int, timeout: float = 30.0) -> int:
        with self.ran:
            self.ran.wait_for(lambda: self.runs >= count, timeout)
            return self.runs


def test_a_retry_the_broker_cannot_take_keeps_the_link_and_the_call_completes(register, relay, task_log):
    step = FlakyDuringOutage()
    tool = register(make_tool("outage_retry", (Step("FETCH", run=step), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "lookup"}, callback_url=relay.url)
    chains.confirm(call.tool_call_id)
    assert step.entered.wait(15)

    down = BrokerDown(app)
    try:
        step.outage.set()
        step.release.set()  # the step fails transiently; its retry cannot be published
        # The link was not dropped: it is delivered again and runs again, still in the outage.
        assert step.wait_runs(3) >= 3, f"the link ran {step.runs} time(s): its message was dropped"
        during = row(call.tool_call_id)
        assert during.status == "EXECUTING" and during.error_message is None
    finally:
        down.restore()
    step.outage.clear()

    completed = relay.wait_for(call.tool_call_id, "completed", timeout=60)
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and done.result == {"outputs": {"FETCH": {"fetched": True}}}
    assert completed["voice_response"] == done.voice_response == "Did lookup."
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "COMPLETED"]
    fetches = {r.state for r in task_log.ran_for(call.tool_call_id, "tools.outage_retry.FETCH")}
    assert "REJECTED" in fetches and "FAILURE" not in fetches, fetches
    assert [e["event"] for e in relay.events_for(call.tool_call_id)] == ["progress", "completed"]
