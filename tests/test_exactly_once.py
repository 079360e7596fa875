"""Exactly once under concurrency (docs/promises.md, "Exactly once"): copies of a link, stale chains,
and what is said when a side effect's outcome cannot be known.

- A chain is fenced by its id: a confirm whose publish reached the broker but whose answer was lost
  (the call went back to PENDING) and the relay's second confirm make two chains of one call; only
  the current one passes a gate, so the stale chain stops at its first link.
- A side effect is claimed by one copy at a time: two copies of one SENDING link (a duplicated
  publish, a redelivery while the link runs) act once, with one progress event.
- A refusal is "not done" only when no earlier attempt of the effect can have acted; otherwise the
  call ends FAILED with the tool's unconfirmed sentence and ``outcome: "unconfirmed"``.

Steps that must meet a second copy wait for it a bounded time (:class:`Meeting`): on the code
without fences both copies enter and meet; with them the second copy never enters.
"""
from __future__ import annotations

import threading
import time

import pytest

import voice_tools_backends as backends
from tasks import chains
from tasks.calls import actions
from tasks.tools import Step, TransientError
from tests.helpers import deliveries, make_call, row, wait_status
from tests.test_chains import make_tool, register, task_log  # noqa: F401  (fixtures)
from tests.test_worker_loss import inserts_waiting, outbox_row_held, outbox_rows, wait_until

SEND = "tools.send_email."


class Meeting:
    """A step that waits (at most ``patience`` seconds) for a second run of itself to come in."""

    def __init__(self, output, patience: float = 3.0):
        self.output, self.patience = output, patience
        self.runs, self.lock, self.met = 0, threading.Lock(), threading.Event()

    def __call__(self, step):
        with self.lock:
            self.runs += 1
            if self.runs >= 2:
                self.met.set()
        self.met.wait(self.patience)
        return self.output


@pytest.fixture
def held_queue(worker, celery_app_instance):
    """Register a test tool whose queue the running worker consumes only once the test calls ``consume``."""
    app, registered, consumed = celery_app_instance, [], []

    class Held:
        def register(self, tool):
            chains.register_tool(tool)
            registered.append(tool)
            worker.consumer.update_strategies()
            return tool

        def consume(self, tool):
            replies = app.control.add_consumer(tool.queue, reply=True, destination=[worker.hostname], timeout=10)
            assert replies, "the worker did not answer add_consumer"
            consumed.append(tool)

    yield Held()
    for tool in consumed:
        app.control.cancel_consumer(tool.queue, reply=True, destination=[worker.hostname], timeout=10)
    for tool in registered:
        chains.unregister_tool(tool.name)


@pytest.mark.slow
def test_a_stale_chain_stops_at_its_first_gate(held_queue, lost_publish_answer, relay, task_log):  # noqa: F811
    """confirm: the publish lands, its answer is lost, the call goes back to PENDING (503); the relay
    confirms again: a second chain. The first chain's messages are still in the queue: they run, and
    stop at their first gate. The draft step and the side effect each run once."""
    draft, effect = Meeting({"draft": True}), Meeting({"done": True})
    tool = held_queue.register(make_tool("stale_chain", (
        Step("DRAFT", run=draft), Step("APPLY", run=effect, side_effect=True), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    lost_publish_answer(lambda: True)
    with pytest.raises(chains.BrokerUnavailable):
        actions.confirm(call.tool_call_id)
    assert row(call.tool_call_id).status == "PENDING"
    actions.confirm(call.tool_call_id)  # the relay's second confirm: a second chain
    assert len(task_log.published_for(call.tool_call_id, "tools.stale_chain.DRAFT")) == 2

    held_queue.consume(tool)
    relay.wait_for(call.tool_call_id, "completed")
    task_log.wait_ran(call.tool_call_id, "tools.stale_chain.DRAFT", count=2)  # both chains' first links ran
    assert (draft.runs, effect.runs) == (1, 1), "each step ran once: the stale chain stopped at its first gate"
    done = row(call.tool_call_id)
    assert done.status == "COMPLETED" and done.outcome == "done"
    assert [e["event"] for e in relay.events_for(call.tool_call_id)] == ["progress", "progress", "completed"]


def test_two_copies_of_one_sending_link_send_once(worker, relay, task_log):  # noqa: F811
    """A resumed send_email's SENDING link is held inside its send (the outbox row is held by the test);
    a second copy of that very message comes in. It finds the side effect claimed and does not act:
    one send, one SENDING progress event."""
    call = make_call(callback_url=relay.url, parameters={"to": "twice@example.com", "subject": "Copies"})
    id_ = call.tool_call_id
    actions.confirm(id_)
    wait_status(id_, "PREPARED")
    inside = []
    with outbox_row_held(id_):
        actions.resume(id_)
        wait_until(lambda: inserts_waiting() >= 1, "the SENDING link to wait inside its send")
        (sending,) = task_log.published_for(id_, SEND + "SENDING")
        chains.LINKS["send_email"][2].apply_async(sending.args)  # the same message, a second time
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the copy either waits on the claim or enters the send too
            inside.append(inserts_waiting())
            if inside[-1] >= 2 or task_log.ran_for(id_, SEND + "SENDING"):
                break
            time.sleep(0.05)
    assert max(inside) == 1, "the second copy entered the send while the first was inside it"
    done = wait_status(id_, timeout=60)
    assert done.status == "COMPLETED" and outbox_rows(id_) == 1
    sending_events = [d for d in deliveries(id_, "progress") if d.payload["step"] == "SENDING"]
    assert len(sending_events) == 1
    assert done.effect_attempts == 1


# -- "maybe" when it is maybe ------------------------------------------------------------------


class AmbiguousThenRefused:
    """A side effect whose first attempt times out (it may have acted), then is refused."""

    def __init__(self):
        self.runs, self.seen = 0, []

    def __call__(self, step):
        self.runs += 1
        self.seen.append(step.earlier_attempt)
        if self.runs == 1:
            raise TransientError("HTTP 503 from the service (the request may have gone through)")
        raise backends.Refused("HTTP 403: the service refused the request")


def test_a_refusal_after_an_ambiguous_attempt_is_unconfirmed(register, relay, task_log):  # noqa: F811
    effect = AmbiguousThenRefused()
    tool = register(make_tool("ambiguous_a", (Step("APPLY", run=effect, side_effect=True), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=30)
    done = row(call.tool_call_id)
    unconfirmed = "I could not confirm that the ambiguous a request went through. Please check before trying again."
    assert done.status == "FAILED" and done.voice_response == failed["voice_response"] == unconfirmed
    assert done.outcome == failed["outcome"] == "unconfirmed"
    assert effect.seen == [False, True], "the retry knew an earlier attempt may have acted"


def test_a_refusal_of_the_first_attempt_is_not_done(register, relay, task_log):  # noqa: F811
    def refused(step):
        raise backends.Refused("HTTP 403: the service refused the request")

    tool = register(make_tool("refused_a", (Step("APPLY", run=refused, side_effect=True), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=30)
    done = row(call.tool_call_id)
    assert done.voice_response == "The transfer did not happen: HTTP 403: the service refused the request."
    assert done.outcome == failed["outcome"] == "not_done"


def test_a_backend_that_cannot_tell_ends_the_call_unconfirmed(register, relay, task_log):  # noqa: F811
    def unknown(step):
        raise backends.Unconfirmed("the sent mail does not show the message yet")

    tool = register(make_tool("unknown_a", (Step("APPLY", run=unknown, side_effect=True), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "transfer"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=30)
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and done.outcome == failed["outcome"] == "unconfirmed"
    assert done.voice_response == ("I could not confirm that the unknown a request went through. "
                                   "Please check before trying again.")


def test_a_claim_is_known_abandoned_only_when_its_holder_process_on_this_host_is_gone():
    import subprocess
    import sys

    from tasks.effect_claims import THIS_HOST, claim_token, holder_gone

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    assert holder_gone(f"{THIS_HOST}:{dead.pid}:abc") is True
    assert holder_gone(claim_token()) is False, "this very process holds it"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert holder_gone(f"{THIS_HOST}:{live.pid}:abc") is False
    finally:
        live.kill()
        live.wait()
    assert holder_gone(f"another-host/1:{dead.pid}:abc") is False, "another host's process cannot be told: wait"
    assert holder_gone(None) is False and holder_gone("garbage") is False


def token_written_on(tmp_path, boot_id: str | None = None, hostname: str | None = None) -> str:
    """A claim token as a worker's process writes it, on a kernel whose boot id is ``boot_id`` and a host
    named ``hostname`` (a mount and UTS namespace of their own, root only), in this pid namespace; the
    process has ended when it is returned."""
    import os
    import subprocess
    import sys

    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: another boot id is made with a mount namespace")
        pytest.skip("another boot id needs a mount namespace (root)")
    steps = []
    if boot_id is not None:
        (tmp_path / "boot_id").write_text(boot_id + "\n")
        steps.append(f"mount --bind {tmp_path / 'boot_id'} /proc/sys/kernel/random/boot_id")
    if hostname is not None:
        steps.append(f"hostname {hostname}")
    python = f"{sys.executable} -c 'from tasks.effect_claims import claim_token; print(claim_token())'"
    made = subprocess.run(["unshare", "--mount", "--uts", "sh", "-c", " && ".join(steps + [f"exec {python}"])],
                          capture_output=True, text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def test_a_claim_is_taken_over_early_only_from_this_boot_and_pid_namespace(tmp_path):
    """A pid means something only within one boot of one kernel, in one pid namespace. Every host's
    initial pid namespace has the same inode, and cloned hosts keep one name: a holder on another
    machine (another boot id) whose host name and namespace are this one's may still run, and its
    claim waits for its lease. A process of this boot and namespace that is gone is taken over early."""
    import socket

    from tasks.effect_claims import holder_gone

    here = socket.gethostname()
    other_machine = token_written_on(tmp_path, boot_id="0b0e1d2c-3a4b-4c5d-8e6f-708192a3b4c5", hostname=here)
    assert holder_gone(other_machine) is False, f"{other_machine}: another kernel's pid cannot be told here: wait"
    this_machine = token_written_on(tmp_path, hostname=here)
    assert holder_gone(this_machine) is True, f"{this_machine}: a gone process of this boot is taken over early"


def test_a_claim_names_its_host_whole_and_fits_its_column(tmp_path):
    """The token names the host by its whole name (for people; a Linux host name has up to 64
    characters), and is stored whole."""
    long_name = "voice-tools-worker-prod-eu1-" + "x" * 28 + ".example"
    assert len(long_name) == 64
    token = token_written_on(tmp_path, hostname=long_name)
    assert long_name in token
    call = make_call(parameters={"to": "claims@example.com", "subject": "Holder"})
    from models import db, lifecycle

    with db.statement() as s:
        lifecycle.confirm(s, call.tool_call_id, workflow_id="holder-chain")
        claimed = lifecycle.begin_step(s, call.tool_call_id, "SENDING", 0.5, commit=True, chain="holder-chain",
                                       token=token, lease_s=70)
    assert claimed.effect_claimed_by == token == row(call.tool_call_id).effect_claimed_by


def test_a_run_again_of_a_call_whose_link_still_runs_sends_once_and_completes(worker, relay, task_log):  # noqa: F811
    """The stuck-call sweep's run again of a committed call whose SENDING link is in fact still inside
    its send: the new chain's SENDING finds the send claimed and does not act; the running link sends,
    and what follows its send goes on under the call's current chain (the old chain's own next link
    would stop at its gate)."""
    call = make_call(callback_url=relay.url, parameters={"to": "again@example.com", "subject": "Run again"})
    id_ = call.tool_call_id
    actions.confirm(id_)
    wait_status(id_, "PREPARED")
    with outbox_row_held(id_):
        actions.resume(id_)
        wait_until(lambda: inserts_waiting() >= 1, "the SENDING link to wait inside its send")
        before = row(id_).workflow_id
        again = actions.redrive(chains.tools.TOOLS["send_email"], id_, older_than_s=0, max_redrives=3)
        assert again is not None and again.workflow_id != before
        task_log.wait_ran(id_, SEND + "SENDING", count=1)  # the new chain's copy: it found the claim
        assert inserts_waiting() == 1, "the new chain's SENDING entered the send too"
    done = wait_status(id_, timeout=20)
    assert done.status == "COMPLETED" and outbox_rows(id_) == 1 and done.effect_attempts == 1
    sending_events = [d for d in deliveries(id_, "progress") if d.payload["step"] == "SENDING"]
    assert len(sending_events) == 1
    assert [e["event"] for e in relay.events_for(id_)].count("completed") == 1
