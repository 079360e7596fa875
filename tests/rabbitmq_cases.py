"""What RabbitMQ does its own way, shown on RabbitMQ (docs/operations.md, RabbitMQ).

Not collected by a plain ``pytest`` run (its name does not start with ``test_``):
``tests/test_rabbitmq_parity.py`` runs it, with the chain, race, worker-loss and API
tests it re-runs, in a pytest of its own whose broker is a RabbitMQ virtual host made
for that run (``CELERY_BROKER_URL=amqp://...``). Run by hand on Redis it skips.

- every queue is a durable quorum queue behind a topic exchange of its own;
- the API answers 503 and leaves the call as it was when RabbitMQ is down, or refuses the
  chain (publisher confirms: never a 202 for a chain RabbitMQ does not have);
- a worker SIGKILLed as a whole: its unacknowledged link is back in its queue as soon as
  its connection closes, with no worker consuming and no visibility timeout, and the next
  worker runs it (on Redis it waits out ``VOICE_TOOLS_VISIBILITY_TIMEOUT``);
- delayed retries (a link's countdown, a callback's eta) wait in the broker's delay
  queues (Celery's native delayed delivery), not in a worker's memory;
- the cancel/resume races of ``tests/test_race.py`` in smaller batches;
- the stuck-call sweep's facts: a queue is seen whole only when every worker consuming it
  answered and no countdown waits in the delay queues, and a backlog makes only its own queue
  "cannot tell".
"""
from __future__ import annotations

import json
import random
from contextlib import contextmanager
from collections import Counter

import pytest
from amqp.exceptions import MessageNacked
from kombu import Connection, Producer
from kombu.transport.native_delayed_delivery import CELERY_DELAYED_DELIVERY_EXCHANGE
from sqlalchemy import text

import celeryconfig
from models import db, lifecycle
from tasks import app, chains
from tasks.calls import actions
from tasks.delivery import attempts
from tests import api_fixtures, rabbitmqctl
from tests.api_fixtures import created_id
from tests.conftest import AUTH
from tests.helpers import make_call, progress_event, row, wait_delivered, wait_status
from tests.tasklog import TaskLog
from tests.test_api_errors import assert_error
from tests.test_race import _commit_latency_s, _prepared_calls, _report, _run_races, _violations
from tests.test_worker_loss import (CLAIMS_WITHOUT_LOSS, QUEUE, SENDING, assert_sent_once,
                                    link_held_in_side_effect, outbox_row_held, prepared_call, wait_until)
from support.worker_process import WorkerProcess, queues_taken_from_others

pytestmark = pytest.mark.skipif(not celeryconfig.AMQP, reason="the broker is not RabbitMQ: run through "
                                                               "tests/test_rabbitmq_parity.py")

# calls per batch (tests/test_race.py races 300 and 150 on Redis); more batches while one outcome is missing
RESUME_VS_CANCEL = 40
CANCEL_VS_LINK = 30
CALIBRATION = 6


def vhost() -> str:
    return app.connection_for_write().as_uri().rsplit("/", 1)[1]


def ready_messages(queue: str) -> int:
    """Messages waiting in ``queue`` for a consumer (those delivered and unacknowledged not counted)."""
    with app.connection_for_write() as conn:
        return conn.default_channel.queue_declare(queue=queue, passive=True).message_count


def rabbitmq_queues() -> dict[str, tuple[str, str]]:
    """name -> (type, durable) of this run's virtual host, as RabbitMQ lists them."""
    return {name: (kind, durable) for name, kind, durable in rabbitmqctl.listed("queues", vhost(), "name", "type",
                                                                                 "durable")}


def test_every_queue_is_a_durable_quorum_queue_behind_a_topic_exchange(worker):
    for queue in app.amqp.queues.values():
        assert queue.queue_arguments == {"x-queue-type": "quorum"} and queue.durable
        assert (queue.exchange.name, queue.exchange.type, queue.routing_key) == (queue.name, "topic", queue.name)
    assert "visibility_timeout" not in (app.conf.broker_transport_options or {})
    declared = rabbitmq_queues()
    for name in ("tools.send_email", "callbacks", "maintenance"):
        assert declared[name] == ("quorum", "true"), declared
    # the delay queues of native delayed delivery, declared by the worker
    assert declared["celery_delayed_0"] == ("quorum", "true") and declared["celery_delayed_27"][0] == "quorum"


# -- the API when RabbitMQ is down ----------------------------------------------------


@pytest.fixture
def rabbitmq_down(monkeypatch):
    """The app's producers pointed at a closed port as ``amqp://``: py-amqp's errors, not redis-py's."""
    monkeypatch.setattr(api_fixtures, "CLOSED_PORT_BROKER", "amqp://guest:guest@127.0.0.1:1//")
    down = api_fixtures.BrokerDown(app)
    yield down
    down.restore()


def test_rabbitmq_down_answers_503_on_confirm_resume_and_readyz_and_changes_no_call(client, rabbitmq_down):
    pending_id, prepared_id = created_id(client), created_id(client)
    with db.session() as s:
        lifecycle.confirm(s, prepared_id)
        lifecycle.checkpoint(s, prepared_id, "READY_TO_SEND", 0.25)
    confirm = assert_error(client.post(f"/voice-tools/confirm/{pending_id}", headers=AUTH), 503, "unavailable")
    resume = assert_error(client.post(f"/voice-tools/resume/{prepared_id}", headers=AUTH, json={"action": "proceed"}),
                          503, "unavailable")
    assert confirm["details"]["service"] == resume["details"]["service"] == "broker"
    assert (row(pending_id).status, row(pending_id).workflow_id) == ("PENDING", None)
    assert (row(prepared_id).status, row(prepared_id).committed_at) == ("PREPARED", None)
    ready = assert_error(client.get("/readyz", headers=AUTH), 503, "unavailable")
    assert ready["details"]["down"] == ["broker"]


@pytest.fixture
def own_queue():
    with queues_taken_from_others(app, [QUEUE]):
        yield


@pytest.fixture
def send_email_queue_refusing():
    with send_email_refused():
        yield


@contextmanager
def send_email_refused():
    """A RabbitMQ policy that makes tools.send_email refuse every message (max length 0,
    reject-publish), in force once a plain publish there is refused: RabbitMQ applies a
    policy to a quorum queue a moment after it lists it, and a quorum queue takes a message
    while it is below its limit (an empty one takes the first). No consumer must be on it."""
    send_email = app.amqp.queues[QUEUE]
    with app.connection_for_write() as conn:
        send_email.bind(conn.default_channel).declare()  # as a worker does (none may have run yet)
    rabbitmqctl.run("set_policy", "-p", vhost(), "refuse-send-email", r"^tools\.send_email$",
                    '{"max-length": 0, "overflow": "reject-publish"}', "--apply-to", "queues", "--priority", "9")

    def refused() -> bool:  # asked on a connection of its own, with publisher confirms whatever the app's are
        with Connection(app.conf.broker_url, transport_options={"confirm_publish": True}) as conn:
            try:
                Producer(conn.default_channel).publish({"probe": True}, exchange=send_email.exchange,
                                                       routing_key=send_email.routing_key)
            except MessageNacked:
                return True
        return False

    try:
        wait_until(refused, "RabbitMQ to refuse messages to tools.send_email")
        yield
    finally:
        # the policy's end too comes a moment later: until then a later test's links to
        # tools.send_email would be refused (a nacked next link fails its call)
        rabbitmqctl.run("clear_policy", "-p", vhost(), "refuse-send-email")
        wait_until(lambda: not refused(), "RabbitMQ to take messages to tools.send_email again")
        with app.connection_for_write() as conn:
            send_email.bind(conn.default_channel).purge()


def test_a_chain_rabbitmq_refuses_is_503_and_the_call_pending_again_never_202(client, own_queue,
                                                                                  send_email_queue_refusing):
    """Publisher confirms: a publish returns once RabbitMQ has the message (as a Redis LPUSH
    answers once Redis has it), so a refused one is BrokerUnavailable, not a chain that is not there."""
    tool_call_id = created_id(client)
    answer = client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH)
    assert assert_error(answer, 503, "unavailable")["details"]["service"] == "broker"
    stored = row(tool_call_id)
    assert (stored.status, stored.workflow_id) == ("PENDING", None)
    assert [h["status"] for h in stored.status_history] == ["PENDING", "EXECUTING", "PENDING"]


def test_once_rabbitmq_takes_messages_again_a_confirm_refused_before_is_sent(client, own_queue):
    """RabbitMQ leaves a channel that had a publish to a quorum queue refused (basic.nack) refusing
    that queue for good, even once the queue takes messages again on any other channel (seen with
    RabbitMQ 3.x here): the API's publishes must not stay on such a channel, or a process would
    answer 503 to every confirm of that tool until it restarted."""
    tool_call_id = created_id(client)
    with send_email_refused():
        refused = client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH)
        assert assert_error(refused, 503, "unavailable")["details"]["service"] == "broker"
    answer = client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH)
    assert answer.status_code == 202, answer.get_data(as_text=True)
    assert row(tool_call_id).status == "EXECUTING"
    assert ready_messages(QUEUE) == 1, "its first link is in its queue"


# -- a whole worker lost ---------------------------------------------------------------


def test_whole_worker_killed_mid_link_its_message_is_back_in_the_queue_at_once(own_queue, tmp_path):
    first_worker = WorkerProcess(app, [QUEUE], concurrency=2, log_dir=tmp_path, name="rabbit-first")
    second_worker = WorkerProcess(app, [QUEUE], concurrency=2, log_dir=tmp_path, name="rabbit-second")
    try:
        first_worker.start()
        tool_call_id = prepared_call("rabbit_whole")
        with outbox_row_held(tool_call_id):
            actions.resume(tool_call_id)
            first = link_held_in_side_effect(first_worker, tool_call_id)
            assert ready_messages(QUEUE) == 0, "the SENDING message is out with the worker, unacknowledged"
            first_worker.kill()
            assert row(tool_call_id).status == "EXECUTING"
            # No worker consumes the queue now: RabbitMQ itself put the message back when
            # the dead worker's connection closed (Redis would hide it for the visibility timeout).
            wait_until(lambda: ready_messages(QUEUE) == 1, "RabbitMQ to requeue the lost worker's message")
            second_worker.start()
            again = second_worker.wait_active(SENDING, [tool_call_id], timeout=60)
            assert again["id"] == first["id"], "the same message, delivered again"
        assert_sent_once(tool_call_id)
        assert row(tool_call_id).attempts == CLAIMS_WITHOUT_LOSS + 1, "SENDING claimed twice, everything else once"
        assert f"{SENDING}[{first['id']}] received" in second_worker.log()
        assert ready_messages(QUEUE) == 0
    finally:
        first_worker.stop()
        second_worker.stop()


# -- delayed retries ---------------------------------------------------------------------


def delayed(routing_key: str | None, queue: str) -> bool:
    """Published through the delay exchanges: ``<28 bits of delay>.<queue>``."""
    bits = (routing_key or "").split(".")[:28]
    return routing_key is not None and routing_key.endswith(f".{queue}") and set(bits) <= {"0", "1"} \
        and len(bits) == 28


def test_a_failed_callback_is_retried_through_the_brokers_delay_queues(worker, relay):
    answered: list[str] = []

    def first_fails(event):
        answered.append(event["event_id"])
        return 500 if len(answered) == 1 else None

    relay.answer(first_fails)
    with TaskLog() as log:
        call = make_call(callback_url=relay.url)
        actions.confirm(call.tool_call_id)
        wait_status(call.tool_call_id, "PREPARED")
        event_id = answered[0]
        done = wait_delivered(event_id)
        log.wait_ran(event_id, "callbacks.deliver")
    assert done.attempts == 2 and done.response_code == 200 and done.state == "delivered"
    assert [(a["response_code"], a["error"]) for a in done.attempt_log] == [(500, "HTTP 500"), (200, None)]
    [retry] = log.published_for(event_id, "callbacks.deliver")
    assert retry.eta and delayed(retry.queue, "callbacks"), retry


def test_a_callback_retry_due_in_less_than_a_second_is_published_and_attempted(worker, relay):
    """The broker's delay queues count whole seconds, and Celery refuses to publish a delay
    under one second there (ValueError): the retry is published rounded up to a second."""
    due_in_s = 0.4
    answers = iter([500])
    relay.answer(lambda event: next(answers, None))
    _, event_id = progress_event(relay.url)
    assert not attempts.attempt(event_id).delivered  # the relay answered 500: pending, retry due
    with db.session() as s:
        s.execute(text("UPDATE callback_deliveries SET next_attempt_at = now() + make_interval(secs => :s) "
                       "WHERE event_id = :e"), {"s": due_in_s, "e": event_id})
    with TaskLog() as log:
        attempts.schedule_retry(event_id)
    [retry] = log.published_for(event_id, "callbacks.deliver")
    assert delayed(retry.queue, "callbacks") and retry.queue.startswith("0." * 27 + "1."), retry  # 1 s
    done = wait_delivered(event_id, timeout=15)
    assert (done.attempts, done.response_code) == (2, 200)
    assert [a["response_code"] for a in done.attempt_log] == [500, 200]


def test_a_link_retry_waits_in_the_brokers_delay_queues_on_a_quorum_queue(tmp_path):
    """A tool's step fails twice (transient) in a real worker whose queues include the tool's
    (so its quorum queue is bound to the delay exchanges when it starts): each countdown
    retry is published to the delay exchanges and comes back from the broker when due."""
    from tests import rabbitmq_tools  # registers the tool here too, to enqueue its chain

    tool = rabbitmq_tools.FLAKY
    fetch = tool.task_name(tool.steps[0])
    chains.register_tool(tool)
    try:
        with WorkerProcess(app, [tool.queue], concurrency=2, log_dir=tmp_path, name="rabbit-flaky",
                           include=["tests.rabbitmq_tools"]) as flaky_worker:
            call = make_call(tool.name, {"what": "lookup"})
            actions.confirm(call.tool_call_id)
            done = wait_status(call.tool_call_id, timeout=60)
            log = flaky_worker.log()
    finally:
        chains.unregister_tool(tool.name)
    assert (done.status, done.result) == ("COMPLETED", {"FETCH": {"tries": 3}}), (done.status, done.error_message)
    assert done.attempts == 4  # FETCH three times, COMPLETED once
    assert log.count("retry: Retry in") == 2 and log.count(f"{fetch}[") - log.count("retry: Retry in") >= 3, \
        log[-3000:]
    messages = [json.loads(line)["message"] if line.startswith("{") else line for line in log.splitlines()]  # JSON logs
    retries = [message.split("routing_key=")[1] for message in messages
               if f"published {fetch} retries=" in message and "exchange=celery_delayed_27 " in message]
    assert len(retries) == 2 and all(delayed(key, tool.queue) for key in retries), log[-3000:]
    assert rabbitmq_queues()[tool.queue] == ("quorum", "true")


def test_the_delay_exchange_forwards_to_every_queue_of_the_app(worker):
    """Each queue's exchange is bound to the delay exchange with ``#.<queue>`` (a worker started)."""
    bindings = set(rabbitmqctl.listed("bindings", vhost(), "source_name", "destination_name", "routing_key"))
    for queue in app.amqp.queues.values():
        assert (CELERY_DELAYED_DELIVERY_EXCHANGE, queue.name, f"#.{queue.name}") in bindings, queue.name


# -- the races -------------------------------------------------------------------------


def race_batches(tag: str, delays, resume_first: bool, batch: int, at_most: int) -> dict:
    """``tests/test_race.py``'s races in batches of ``batch`` calls until both outcomes have
    occurred (at most ``at_most`` calls): zero violations in every batch."""
    answers: dict = {}
    outcomes: Counter = Counter()
    while len(answers) < at_most:
        ids = _prepared_calls(batch, f"{tag}{len(answers)}")
        answered = _run_races(ids, delays, resume_first=resume_first)
        problems, found = _violations(ids, answered)
        assert problems == [], problems
        answers.update(answered)
        outcomes += found
        if {o.split(" ")[0] for o in outcomes} == {"CANCELLED", "COMPLETED"}:
            break
    _report(f"RabbitMQ: {tag}, {len(answers)} races", outcomes, [])
    finals = Counter(o.split(" ")[0] for o in outcomes.elements())
    assert finals["CANCELLED"] > 0 and finals["COMPLETED"] > 0, finals
    return answers


def test_resume_races_cancel_at_the_checkpoint_on_rabbitmq(worker):
    spread = max(_commit_latency_s(_prepared_calls(CALIBRATION, "calibrate")), 0.001)
    race_batches("resume vs cancel", lambda: (random.uniform(0, 2 * spread), random.uniform(0, 5 * spread)),
                 resume_first=False, batch=RESUME_VS_CANCEL, at_most=3 * RESUME_VS_CANCEL)


def test_cancel_races_the_sending_link_on_rabbitmq(worker):
    spread = max(3 * _commit_latency_s(_prepared_calls(CALIBRATION, "calibrate")), 0.003)
    answers = race_batches("cancel vs SENDING link", lambda: (0.0, random.uniform(0, spread)),
                           resume_first=True, batch=CANCEL_VS_LINK, at_most=3 * CANCEL_VS_LINK)
    assert all(resumed.ok for resumed, _ in answers.values()), "every resume came first and must have applied"


# -- the stuck-call sweep's facts -------------------------------------------------------------


def test_a_link_held_by_a_worker_that_does_not_answer_is_never_taken_for_lost(own_queue, tmp_path):
    """docs/operations.md, VOICE_TOOLS_STUCK_EXECUTING_AFTER: on RabbitMQ a delivered link is seen
    only through the worker holding it, so a queue counts as seen whole only when every worker
    consuming it answered (RabbitMQ's consumer count), not when one did."""
    import os
    import signal

    from tasks import liveness

    workers = [WorkerProcess(app, [QUEUE], concurrency=2, log_dir=tmp_path, name=f"rabbit-facts-{n}")
               for n in (1, 2)]
    try:
        for w in workers:
            w.start()
        tool_call_id = prepared_call("rabbit_facts")
        with outbox_row_held(tool_call_id):
            actions.resume(tool_call_id)
            wait_until(lambda: any(r["name"] == SENDING and list(r["args"])[:1] == [tool_call_id]
                                   for w in workers for r in w.active()), "SENDING to run on a worker")
            [holder] = [w for w in workers if any(list(r["args"])[:1] == [tool_call_id] for r in w.active())]
            [other] = [w for w in workers if w is not holder]
            facts = liveness.read(app, [QUEUE])
            assert facts.lost(tool_call_id, QUEUE) is False, "both workers answer: the link is seen"
            os.kill(holder.pid, signal.SIGSTOP)  # its main process answers no inspect; its child still runs
            try:
                assert other.active(timeout=1.0) == []
                facts = liveness.read(app, [QUEUE])
                assert facts.lost(tool_call_id, QUEUE) is None, "one worker did not answer: cannot tell"
            finally:
                os.kill(holder.pid, signal.SIGCONT)
        assert_sent_once(tool_call_id)
    finally:
        for w in workers:
            w.stop()


def test_a_backlog_in_another_queue_leaves_a_lost_call_judged_by_its_own_queue(worker):
    """A backlog makes only its own queue "cannot tell": a call whose queue is empty and whose
    link is nowhere is lost, whatever waits in another tool's queue."""
    from tasks import liveness

    other = "tools.create_task"
    with app.connection_for_write() as conn:  # an earlier test's countdown (a copy waiting out a claim's
        for delay_queue in liveness.DELAY_QUEUES:  # lease, about a minute) must not spoil these facts
            conn.default_channel.queue_purge(delay_queue)
    lost = make_call()
    waiting = make_call("create_task", {"title": "Call the bank"})
    with queues_taken_from_others(app, [QUEUE, other]):
        with app.connection_for_write() as conn:  # nothing an earlier test left waits there
            celeryconfig.queue(other).bind(conn.default_channel).purge()
        actions.confirm(lost.tool_call_id)
        with app.connection_for_write() as conn:  # the broker loses its link
            celeryconfig.queue(QUEUE).bind(conn.default_channel).purge()
        actions.confirm(waiting.tool_call_id)
        assert ready_messages(other) == 1
        # the facts cannot tell while anything else waits on the broker's side (a countdown in the
        # delay queues, an earlier test's message on its way): read them again until they can,
        # the backlog in the other queue still there
        read: list = []
        wait_until(lambda: read.append(liveness.read(app, [QUEUE, other])) or read[-1].lost(
            lost.tool_call_id, QUEUE) is not None, "the facts to judge the call on its own queue", timeout=30)
        assert ready_messages(other) == 1
    facts = read[-1]
    assert facts.lost(lost.tool_call_id, QUEUE) is True
    assert facts.lost(waiting.tool_call_id, other) is None


def test_a_link_waiting_for_its_countdown_in_the_delay_queues_is_never_taken_for_lost(worker, own_queue):
    """A retry's countdown waits in the broker's delay queues, where no worker and no tool queue
    shows it: while anything waits there, no tool queue counts as seen whole."""
    from tasks import liveness

    call = make_call()
    with db.session() as s:
        lifecycle.confirm(s, call.tool_call_id)
    chains.LINKS["send_email"][0].si(call.tool_call_id).apply_async(countdown=120)  # as a retry is
    try:
        assert ready_messages(QUEUE) == 0
        facts = liveness.read(app, [QUEUE])
        assert facts.lost(call.tool_call_id, QUEUE) is None, "it may wait for its countdown: cannot tell"
    finally:
        with app.connection_for_write() as conn:  # the countdown is not left for later tests
            for delay_queue in liveness.DELAY_QUEUES:
                conn.default_channel.queue_purge(delay_queue)


# -- Flower on RabbitMQ ----------------------------------------------------------------

def management_api() -> str:
    """RabbitMQ's management API (its ``rabbitmq_management`` plugin), as Flower's ``FLOWER_BROKER_API`` names it:
    ``VOICE_TOOLS_TEST_RABBITMQ_API``, else the broker's host and user on port 15672."""
    import os
    from urllib.parse import urlsplit

    given = os.environ.get("VOICE_TOOLS_TEST_RABBITMQ_API", "").strip()
    if given:
        return given
    broker = urlsplit(app.connection_for_write().as_uri(include_password=True))
    return f"http://{broker.username}:{broker.password}@{broker.hostname}:15672/api/"


def test_flower_shows_every_queues_length_through_the_management_api(worker, tmp_path):
    """docs/operations.md, Flower: on RabbitMQ Flower reads the queues' lengths from RabbitMQ's management API
    (``FLOWER_BROKER_API``, Flower's ``--broker-api``): every queue of the app, as RabbitMQ counts it."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import requests

    api = management_api()
    try:
        requests.get(f"{api.rstrip('/')}/overview", timeout=5).raise_for_status()
    except requests.RequestException as exc:
        message = (f"RabbitMQ's management API does not answer at {api.split('@')[-1]} ({exc}): "
                   "rabbitmq-plugins enable rabbitmq_management (or set VOICE_TOOLS_TEST_RABBITMQ_API)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(FLOWER_BASIC_AUTH="ops:flower-rabbit", FLOWER_BROKER_API=api)
    log = tmp_path / "flower.log"
    with open(log, "wb") as sink:
        flower = subprocess.Popen([sys.executable, "-m", "voice_tools", "flower", "--address=127.0.0.1",
                                   f"--port={port}"], env=env, stdout=sink, stderr=subprocess.STDOUT)
    # Flower lists the queues its workers consume (a tool registered by another test here may have none)
    answers = app.control.inspect(timeout=5).active_queues() or {}
    wanted = {queue["name"] for queues in answers.values() for queue in queues}
    assert {"callbacks", "maintenance", "tools.send_email", "tools.search_documentation"} <= wanted, answers
    try:
        # A queue's counts are there once RabbitMQ has collected its statistics (every 5 s), and they are that
        # sample's: a message taken or put back since (a worker stopped by the case before) shows in
        # rabbitmqctl's live count first. So Flower's figures must come to agree with rabbitmqctl's, within
        # a deadline: a queue missing, or a figure that never matches, fails.
        deadline, listed, counted = time.monotonic() + 90, {}, {}
        while not (wanted <= {name for name, count in listed.items() if count is not None}
                   and all(listed[name] == int(counted.get(name, -1)) for name in wanted)):
            assert time.monotonic() < deadline, \
                f"Flower listed {listed}, rabbitmqctl {counted}, for {sorted(wanted)}:\n{log.read_text()[-3000:]}"
            assert flower.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
            try:
                answer = requests.get(f"http://127.0.0.1:{port}/api/queues/length", auth=("ops", "flower-rabbit"),
                                      timeout=10)
                if answer.status_code == 200:
                    listed = {q["name"]: q.get("messages") for q in answer.json()["active_queues"]}
                    counted = dict(rabbitmqctl.listed("queues", vhost(), "name", "messages"))
            except requests.RequestException:
                pass
    finally:
        flower.terminate()
        flower.wait(30)
    assert "management API call failed" not in log.read_text()


# -- what a first start logs ---------------------------------------------------------------

def test_a_worker_of_some_queues_on_an_empty_virtual_host_logs_the_lines_the_operations_guide_quotes(tmp_path):
    """docs/operations.md, RabbitMQ, "the first start on an empty virtual host": each line the row quotes (… for
    what varies) is in the log of a worker consuming one group's queue, started on a new virtual host."""
    import re
    import time
    import uuid
    from pathlib import Path
    import subprocess
    from urllib.parse import quote, urlsplit, urlunsplit

    from support.procs import ROOT

    guide = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    [row] = [line for line in guide.splitlines() if line.startswith("| the first start on an empty virtual host |")]
    quoted = re.findall(r"`([^`]*(?:Failed|failures)[^`]*)`", row)
    assert len(quoted) == 4, quoted
    patterns = [".*?".join(re.escape(part) for part in line.split("…")) for line in quoted]

    ours = urlsplit(app.connection_for_write().as_uri(include_password=True))
    name = f"voice-tools-empty-{uuid.uuid4().hex[:8]}"
    rabbitmqctl.run("add_vhost", name)
    try:
        rabbitmqctl.run("set_permissions", "-p", name, ours.username, ".*", ".*", ".*")
        url = urlunsplit(ours._replace(path=f"/{quote(name, safe='')}"))
        worker = WorkerProcess(app, ["tools.send_email"], concurrency=1, log_dir=tmp_path, name="firststart",
                               env={"CELERY_BROKER_URL": url})
        # started by hand: WorkerProcess.start() pings it through this run's virtual host, not the new one
        worker.proc = subprocess.Popen(worker.argv, cwd=ROOT, env=worker.env, start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while f"{worker.name} ready." not in worker.log():  # delayed delivery is set up before it is ready
                assert worker.proc.poll() is None and time.monotonic() < deadline, worker.log()[-3000:]
                time.sleep(0.5)
            log = worker.log()
        finally:
            worker.stop()
    finally:
        rabbitmqctl.run("delete_vhost", name)
    for line, pattern in zip(quoted, patterns):
        assert re.search(pattern, log), f"not in the worker's log: {line}\n{log[-3000:]}"
