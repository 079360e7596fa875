"""RabbitMQ parity: the chain, race, worker-loss and API tests on RabbitMQ.

The suite runs on Redis. This module re-runs a chosen subset of it with RabbitMQ as the
broker (quorum queues, docs/operations.md, RabbitMQ), plus ``tests/rabbitmq_cases.py``
(what RabbitMQ does its own way: a lost worker's message back in its queue at once,
delayed retries in the broker's delay queues, the races on a smaller batch):

- the broker URL is read when ``celeryconfig`` is imported, so the subset runs in a
  pytest of its own started with ``CELERY_BROKER_URL=amqp://.../<vhost>``, with its
  own embedded PostgreSQL (as any run), its own in-process and subprocess workers;
- it gets a RabbitMQ virtual host of its own, made for the run and deleted after
  (``rabbitmqctl``, see ``tests/rabbitmqctl.py``), so parallel runs on one RabbitMQ never
  take each other's messages;
- each test of the subset is reported here as one test, passed only if it passed there.

RabbitMQ: ``VOICE_TOOLS_TEST_RABBITMQ`` (default ``amqp://guest:guest@127.0.0.1:5672``,
where these machines run one). The module skips only when nothing answers there.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import quote, urlsplit

import pytest

from tests import rabbitmqctl
from support.procs import ROOT, bare_env

pytestmark = pytest.mark.slow

RABBITMQ = os.environ.get("VOICE_TOOLS_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672").rstrip("/")
CHILD_TIMEOUT_S = 300

PARITY = (
    # a chain end to end: checkpoint, resume, callbacks; cancel at the checkpoint; a redelivered rest of chain
    "tests/test_chains.py::test_send_email_checkpoint_resume_complete",
    "tests/test_chains.py::test_cancel_at_the_checkpoint",
    "tests/test_chains.py::test_redelivered_links_never_send_twice",
    # the API side publishes on amqp
    "tests/test_api_calls.py::test_confirm_answers_202_and_enqueues",
    "tests/test_api_calls.py::test_resume_proceed_202_then_completes",
    "tests/test_api_calls.py::test_resume_cancel_at_checkpoint",
    "tests/test_api_meta.py::test_healthz_and_readyz",
    # SIGKILL of a prefork child mid-link
    "tests/test_worker_loss.py::test_prefork_child_killed_mid_link_is_redelivered_to_another_child",
    # RabbitMQ's own: quorum queues, whole-worker loss, delayed retries, the races (smaller batches)
    "tests/rabbitmq_cases.py::test_every_queue_is_a_durable_quorum_queue_behind_a_topic_exchange",
    "tests/rabbitmq_cases.py::test_rabbitmq_down_answers_503_on_confirm_resume_and_readyz_and_changes_no_call",
    "tests/rabbitmq_cases.py::test_a_chain_rabbitmq_refuses_is_503_and_the_call_pending_again_never_202",
    "tests/rabbitmq_cases.py::test_once_rabbitmq_takes_messages_again_a_confirm_refused_before_is_sent",
    "tests/rabbitmq_cases.py::test_whole_worker_killed_mid_link_its_message_is_back_in_the_queue_at_once",
    "tests/rabbitmq_cases.py::test_a_failed_callback_is_retried_through_the_brokers_delay_queues",
    "tests/rabbitmq_cases.py::test_a_callback_retry_due_in_less_than_a_second_is_published_and_attempted",
    "tests/rabbitmq_cases.py::test_a_link_retry_waits_in_the_brokers_delay_queues_on_a_quorum_queue",
    "tests/rabbitmq_cases.py::test_the_delay_exchange_forwards_to_every_queue_of_the_app",
    "tests/rabbitmq_cases.py::test_resume_races_cancel_at_the_checkpoint_on_rabbitmq",
    "tests/rabbitmq_cases.py::test_cancel_races_the_sending_link_on_rabbitmq",
    # the stuck-call sweep's facts: every consumer of a queue must answer; a backlog spoils only its queue
    "tests/rabbitmq_cases.py::test_a_link_held_by_a_worker_that_does_not_answer_is_never_taken_for_lost",
    "tests/rabbitmq_cases.py::test_a_backlog_in_another_queue_leaves_a_lost_call_judged_by_its_own_queue",
    "tests/rabbitmq_cases.py::test_a_link_waiting_for_its_countdown_in_the_delay_queues_is_never_taken_for_lost",
    # Flower's queue lengths, from RabbitMQ's management API
    "tests/rabbitmq_cases.py::test_flower_shows_every_queues_length_through_the_management_api",
    # the lines a first start on an empty virtual host logs, as the operations guide quotes them
    "tests/rabbitmq_cases.py::test_a_worker_of_some_queues_on_an_empty_virtual_host_logs_the_lines_the_operations_guide_quotes",
)


def _listening() -> bool:
    parts = urlsplit(RABBITMQ)
    try:
        socket.create_connection((parts.hostname, parts.port or 5672), timeout=1).close()
        return True
    except OSError:
        return False


if not _listening():
    pytest.skip(f"no RabbitMQ answers at {urlsplit(RABBITMQ).hostname}:{urlsplit(RABBITMQ).port or 5672} "
                "(set VOICE_TOOLS_TEST_RABBITMQ; these machines run one at 127.0.0.1:5672)",
                allow_module_level=True)


@contextmanager
def vhost_of_this_run() -> Iterator[str]:
    """A broker URL on a new virtual host, deleted (with its queues and messages) afterwards."""
    if rabbitmqctl.command() is None:
        pytest.fail(f"RabbitMQ answers at {RABBITMQ} but there is no rabbitmqctl to make a virtual host for this "
                    "run: put it on PATH or set VOICE_TOOLS_TEST_RABBITMQCTL (e.g. 'docker exec rabbitmq rabbitmqctl')")
    user = urlsplit(RABBITMQ).username or "guest"
    name = f"voice-tools-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    rabbitmqctl.run("add_vhost", name)
    try:
        rabbitmqctl.run("set_permissions", "-p", name, user, ".*", ".*", ".*")
        yield f"{RABBITMQ}/{quote(name, safe='')}"
    finally:
        rabbitmqctl.run("delete_vhost", name)


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """node id -> (passed|failed|error|skipped, what pytest said) from a JUnit XML report."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, said = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, said = child.tag, f"{child.get('message', '')}\n{child.text or ''}"
        found[node] = (outcome, said)
    return found


@pytest.fixture(scope="module")
def rabbitmq_run(tmp_path_factory) -> dict:
    """Run ``PARITY`` once, on RabbitMQ, in a pytest of its own; its outcomes and output."""
    out = tmp_path_factory.mktemp("rabbitmq-parity")
    junit, log = out / "junit.xml", out / "pytest.log"
    with vhost_of_this_run() as broker_url:
        env = bare_env(CELERY_BROKER_URL=broker_url)  # no DATABASE_URL / REDIS_URL: servers of its own
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                     f"--junitxml={junit}", *PARITY], cwd=ROOT, env=env, stdout=sink,
                                    stderr=subprocess.STDOUT)
            try:
                returncode = proc.wait(CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # Ctrl-C: pytest tears its fixtures down (workers, servers) and writes its report
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                returncode = None
    output = log.read_text(errors="replace")
    print(output[-3000:])
    return {"returncode": returncode, "outcomes": _outcomes(junit) if junit.exists() else {}, "output": output,
            "broker_url": broker_url}


@pytest.mark.parametrize("node", PARITY)
def test_passes_on_rabbitmq(rabbitmq_run, node):
    outcome, said = rabbitmq_run["outcomes"].get(node, ("not run", rabbitmq_run["output"][-3000:]))
    assert outcome == "passed", f"{node} on RabbitMQ: {outcome}\n{said[-4000:]}"


def test_the_rabbitmq_run_was_on_rabbitmq_and_ended_clean(rabbitmq_run):
    assert urlsplit(rabbitmq_run["broker_url"]).scheme == "amqp"
    output = rabbitmq_run["output"][-3000:]
    assert rabbitmq_run["returncode"] is not None, f"not done after {CHILD_TIMEOUT_S} s:\n{output}"
    assert rabbitmq_run["returncode"] == 0, rabbitmq_run["output"][-3000:]
    assert f"{len(PARITY)} passed" in rabbitmq_run["output"], rabbitmq_run["output"][-3000:]
