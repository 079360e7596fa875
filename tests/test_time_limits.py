"""Per-tool soft time limits, in a real prefork worker (docs/promises.md, "Surviving faults").

Each link task carries ``soft_time_limit`` = the tool's ``time_limit`` (and a hard
limit 10 s later). A step that outlasts it gets Celery's ``SoftTimeLimitExceeded``
in the pool child; the link treats it as a transient error: retried with backoff up
to the tool's ``max_retries``, then the call is FAILED with a sentence that says
what happened, and the worker stays healthy.
"""
from __future__ import annotations

import re

import pytest

from tasks import app, chains
from tasks.calls import actions
from tests.helpers import make_call, wait_status
from support.worker_process import WorkerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def timed_worker(tmp_path_factory):
    from tests import timed_tools

    for tool in timed_tools.TOOLS:  # in this process too, to enqueue their chains
        chains.register_tool(tool)
    queues = [tool.queue for tool in timed_tools.TOOLS]
    try:
        with WorkerProcess(app, queues, pool="prefork", concurrency=1, log_dir=tmp_path_factory.mktemp("timed"),
                           name="timed", include=["tests.timed_tools"]) as worker:
            yield worker
    finally:
        for tool in timed_tools.TOOLS:
            chains.unregister_tool(tool.name)


def test_a_step_past_its_soft_time_limit_is_retried_then_fails_the_call(timed_worker, relay):
    call = make_call("timed_read", {"what": "lookup"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=60)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED", done.error_message
    assert done.error_message == "step FETCH timed out (gave up after 1 retries)"
    assert done.voice_response == failed["voice_response"] == \
        "The lookup did not happen: step FETCH timed out (gave up after 1 retries)."
    assert done.attempts == 2 and done.committed_at is None
    worker_log = timed_worker.log()
    # Celery's own soft limit fired, its retry machinery re-sent the link, and no task ended in error
    assert "Soft time limit (1s) exceeded for tools.timed_read.FETCH" in worker_log, worker_log[-3000:]
    assert "tools.timed_read.FETCH" in worker_log and "retry: Retry in 1s" in worker_log, worker_log[-3000:]
    assert "raised unexpected" not in worker_log, worker_log[-3000:]
    assert app.control.ping(destination=[timed_worker.name], timeout=2), "the worker is still alive"


def test_a_side_effect_past_its_soft_time_limit_fails_as_unconfirmed(timed_worker, relay):
    call = make_call("timed_write", {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=60)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED" and done.committed_at is not None
    assert done.error_message == "step APPLY timed out (gave up after 0 retries)"
    assert done.voice_response == failed["voice_response"] == \
        "I could not confirm that the timed write request went through. Please check before trying again."


def test_a_step_killed_at_its_hard_time_limit_fails_the_call_at_once(timed_worker, relay):
    """Celery kills the pool child and acknowledges the message; ``Link.on_failure`` (run by the
    worker's main process) fails the call instead of leaving it EXECUTING for the stuck-call sweep."""
    call = make_call("timed_stubborn", {"what": "lookup"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=60)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED" and done.committed_at is None
    assert done.error_message == "step FETCH ran past its hard time limit"
    assert done.voice_response == failed["voice_response"] == \
        "The lookup did not happen: step FETCH ran past its hard time limit."
    assert done.current_step == "FETCH" and done.step_outputs == {}
    worker_log = timed_worker.log()
    # killed once, not redelivered (FETCH has no side effect: its gate counts nothing on the call)
    assert len(re.findall(r"Task tools\.timed_stubborn\.FETCH\[[^\]]+\] received", worker_log)) == 1, \
        worker_log[-3000:]
    assert "Hard time limit (11s) exceeded for tools.timed_stubborn.FETCH" in worker_log
    assert app.control.ping(destination=[timed_worker.name], timeout=5), "the worker replaced its child"
