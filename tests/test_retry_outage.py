"""A retry the broker cannot take (docs/promises.md, "Surviving faults").

A link whose step fails transiently asks Celery to retry it: ``Task.retry`` publishes
a new message (with a countdown) and the running one is then acknowledged. When that
publish fails (the broker is down for the publishing side), Celery's own answer is
``Reject(requeue=False)``: the message is dropped, the chain is gone and the call sat
EXECUTING until the stuck-call sweep failed it as "worker stopped". The link now
hands its message back to the broker instead (``Reject(requeue=True)``), after waiting out
its backoff, so the link is delivered again and runs again once the broker takes publishes
again. The runs are counted on the call (not in the message, whose retry counter a requeue
leaves unchanged): a broker that keeps refusing ends the call FAILED past the tool's
``max_retries``, never an endless loop of runs calling the service.

(1) the publish fails while deliveries go on. The in-process test worker keeps its consumer connection to
the real Redis (deliveries, acknowledgements and requeues go on), while the app's
producers are pointed at a closed port (``tests.api_fixtures.BrokerDown``): every
publish, the retry's included, fails as it does with the broker gone. This is the case
where Celery's drop really loses the link (the drop reaches the broker).
(2) a real Redis (``tests/test_broker_restart.py``'s) is shut down while the step runs and
started again: the retry cannot be published. Celery's drop used to lose the link here
too (the call stayed EXECUTING: its acknowledgement reached Redis once it was back). Now
the message goes back to the queue once Redis is back, or, if the requeue cannot reach it,
stays in Redis's ``unacked`` hash and is restored after the visibility timeout (6 s here):
the link runs again and the call completes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tasks import app, chains
from tasks.calls import actions
from tasks.tools import Step, TransientError
from tests.api_fixtures import BrokerDown
from tests.helpers import make_call, row, wait_status
from tests.test_broker_restart import broker, control  # noqa: F401  (fixtures)
from tests.test_chains import history, make_tool, register, task_log  # noqa: F401  (fixtures)
from tests.test_worker_loss import wait_until
from support.worker_process import ROOT, WorkerProcess


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


@pytest.mark.slow
def test_a_retry_the_broker_cannot_take_keeps_the_link_and_the_call_completes(register, relay, task_log):
    step = FlakyDuringOutage()
    tool = register(make_tool("outage_retry", (Step("FETCH", run=step), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "lookup"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
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


@pytest.mark.slow
def test_a_retry_the_broker_keeps_refusing_stops_at_the_tools_bound(register, relay, task_log, caplog):
    """The broker refuses every publish and never comes back within the test: each run waits out its
    backoff before its message goes back, the runs are counted on the call, and past the tool's
    ``max_retries`` the call ends FAILED, saying so once (one failed event, one traceback at most)."""
    step = FlakyDuringOutage()
    tool = register(make_tool("outage_bound", (Step("FETCH", run=step), Step("COMPLETED")), max_retries=2))
    call = make_call(tool.name, {"what": "lookup"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    assert step.entered.wait(15)

    down = BrokerDown(app)
    try:
        step.outage.set()
        started = time.monotonic()
        step.release.set()
        failed = relay.wait_for(call.tool_call_id, "failed", timeout=30)
        elapsed = time.monotonic() - started
        time.sleep(2)  # no run after the call failed
    finally:
        down.restore()
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and done.error_message == "HTTP 503 from the service (gave up after 2 retries)"
    assert done.voice_response == failed["voice_response"] == (
        "The lookup did not happen: HTTP 503 from the service (gave up after 2 retries).")
    assert done.outcome == failed["outcome"] == "not_done"
    assert step.runs == 3, f"the step ran {step.runs} times against max_retries 2"
    assert elapsed >= 1 + 2, "each refused retry waited out its backoff (1 s, then 2 s)"
    assert [e["event"] for e in relay.events_for(call.tool_call_id)] == ["failed"]
    tracebacks = [r for r in caplog.records if r.exc_info and call.tool_call_id in str(getattr(r, "tool_call_id", ""))]
    assert len(tracebacks) <= 1, [r.getMessage() for r in tracebacks]


# -- (2) a real broker outage ---------------------------------------------------------------------


@pytest.fixture
def outage_tool():
    """The tool, registered in this process too (to record its calls) for this test only: imported at
    collection it would join the registry every other test walks."""
    from tests import outage_tools

    chains.register_tool(outage_tools.OUTAGE_READ)
    try:
        yield outage_tools.OUTAGE_READ
    finally:
        chains.unregister_tool(outage_tools.OUTAGE_READ.name)


def confirm_on(broker_url: str, tool_call_id: str) -> None:
    """``actions.confirm`` in a child process whose broker is ``broker_url`` (the tool registered there too)."""
    env = dict(os.environ, CELERY_BROKER_URL=broker_url, REDIS_URL=broker_url)
    code = "import sys\nimport tests.outage_tools\nfrom tasks.calls import actions\nactions.confirm(sys.argv[1])\n"
    done = subprocess.run([sys.executable, "-c", code, tool_call_id], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_a_retry_during_a_real_broker_outage_runs_again_once_the_broker_is_back(
        broker, control, outage_tool, relay, tmp_path):  # noqa: F811
    steps = tmp_path / "steps"
    steps.mkdir()
    (steps / "outage").touch()
    worker = WorkerProcess(control, [outage_tool.queue], pool="prefork", concurrency=1, log_dir=tmp_path,
                           name="outage", include=["tests.outage_tools"],
                           env={"CELERY_BROKER_URL": broker.url, "REDIS_URL": broker.url,
                                "VOICE_TOOLS_VISIBILITY_TIMEOUT": "6", "VOICE_TOOLS_TEST_STEP_DIR": str(steps)})
    runs = lambda: len((steps / "runs").read_text().splitlines()) if (steps / "runs").exists() else 0  # noqa: E731
    try:
        worker.start()
        call = make_call(outage_tool.name, {"what": "the order"}, callback_url=relay.url)
        confirm_on(broker.url, call.tool_call_id)
        wait_until(lambda: runs() == 1, "the step to run")

        broker.shutdown_save()
        (steps / "release").touch()  # the step fails transiently; the retry cannot be published
        wait_until(lambda: "the retry could not be published" in worker.log(), "the retry's publish to fail")
        assert row(call.tool_call_id).status == "EXECUTING"
        broker.start()
        (steps / "outage").unlink()

        done = wait_status(call.tool_call_id, timeout=90)
        assert done.status == "COMPLETED", (done.status, done.error_message)
        assert done.result == {"FETCH": {"fetched": True}} and done.voice_response == "Found the order."
        assert runs() == 2, "run once more, from the message Redis kept"
        assert relay.wait_for(call.tool_call_id, "completed", timeout=30)["status"] == "COMPLETED"
        assert worker.proc.poll() is None, "the worker lived through the outage"
    finally:
        worker.stop()
