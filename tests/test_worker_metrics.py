"""The workers' Prometheus series (docs/operations.md, Metrics), from a real prefork worker.

A ``celery -A tasks worker --pool prefork`` subprocess writes into a multiprocess
folder of its own (``PROMETHEUS_MULTIPROC_DIR``, as the Procfile's worker lines set it
from ``VOICE_TOOLS_WORKER_METRICS_DIR``); ``voice-tools worker-metrics`` serves that
folder, and the test scrapes it over HTTP after the worker ran two calls: one that
completes and one that fails after a retry. The queue depths are read from the
broker. The API's ``/metrics`` shows none of this.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import requests
from celery.signals import before_task_publish
from prometheus_client.parser import text_string_to_metric_families

from models import db
from tasks import app, chains
from tasks.calls import actions
from tasks.delivery import attempts
from tasks.worker import metrics_page
from tests.conftest import AUTH
from tests.helpers import make_call, row, wait_status
from support.procs import ROOT, free_port
from support.worker_process import WorkerProcess, queues_taken_from_others

pytestmark = pytest.mark.slow

WORKER_SERIES = ("voice_tools_calls_", "voice_tools_step_", "voice_tools_task", "voice_tools_callback_",
                 "voice_tools_redrives", "voice_tools_queue_depth")


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text page: (name, labels) -> value."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def by(found: dict, name: str, label: str, **where: str) -> dict[str, float]:
    """The samples of ``name`` matching ``where``, keyed by ``label``."""
    out: dict[str, float] = defaultdict(float)
    for (sample, labels), number in found.items():
        labels = dict(labels)
        if sample == name and all(labels.get(k) == v for k, v in where.items()):
            out[labels[label]] += number
    return dict(out)


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    from tests import metered_tools

    for tool in metered_tools.TOOLS:  # in this process too, to enqueue their chains
        chains.register_tool(tool)
    try:
        yield metered_tools
    finally:
        for tool in metered_tools.TOOLS:
            chains.unregister_tool(tool.name)


def test_a_real_worker_exports_per_tool_series_served_by_the_exporter(metered, relay, tmp_path):
    """The exporter process serves the folder; the worker's own thread (``--worker-metrics-port``,
    as under ``voice-tools run``) serves the same page."""
    folder = tmp_path / "worker-metrics"
    own_port = free_port()
    folder.mkdir()
    queues = [tool.queue for tool in metered.TOOLS]
    ok = make_call("metered_ok", {"what": "the invoice"}, callback_url=relay.url)
    flaky = make_call("metered_flaky", {"what": "the weather"}, callback_url=relay.url)

    with queues_taken_from_others(app, queues):
        # no worker consumes the tools' queues yet: each chain's first link waits in the broker
        actions.confirm(ok.tool_call_id)
        actions.confirm(flaky.tool_call_id)
        depths = by(samples(scrape_registry(folder)), "voice_tools_queue_depth", "queue")
        assert depths["tools.metered_ok"] == 1 and depths["tools.metered_flaky"] == 1, depths
        assert depths["callbacks"] == 0

        with WorkerProcess(app, queues, pool="prefork", concurrency=2, log_dir=tmp_path, name="metered",
                           include=["tests.metered_tools"], env={"PROMETHEUS_MULTIPROC_DIR": str(folder)},
                           options=["--worker-metrics-host", "127.0.0.1", "--worker-metrics-port", str(own_port)]) as worker:
            relay.wait_for(ok.tool_call_id, "completed", timeout=60)
            relay.wait_for(flaky.tool_call_id, "failed", timeout=60)
            assert wait_status(ok.tool_call_id).status == "COMPLETED"
            failed = wait_status(flaky.tool_call_id)
            assert failed.status == "FAILED" and failed.error_message.startswith("the service is busy"), \
                failed.error_message
            found = samples(scrape_exporter(folder))
            own = requests.get(f"http://127.0.0.1:{own_port}/metrics", timeout=30)
            assert own.status_code == 200
            # nothing ran between the two scrapes; the worker's app also declares the metered tools' queues
            own_depths = {("voice_tools_queue_depth", frozenset({("queue", tool.queue)})): 0.0 for tool in metered.TOOLS}
            assert samples(own.text) == found | own_depths
            assert f"worker metrics of {folder} on http://127.0.0.1:{own_port}/metrics" in worker.log()
            assert "raised unexpected" not in worker.log()
            # the port is the main process's alone, also for a pool child forked after the server started
            assert listening_on(own_port, [worker.pid, *worker.children()]) == [worker.pid]
            lost = worker.children()[0]
            worker.kill_child(lost)
            deadline = time.monotonic() + 30
            while len(set(worker.children()) - {lost}) < 2:
                assert time.monotonic() < deadline, "the lost pool child was not replaced"
                time.sleep(0.2)
            time.sleep(1)  # the new child's worker_process_init has run
            assert listening_on(own_port, [worker.pid, *worker.children()]) == [worker.pid]
            assert requests.get(f"http://127.0.0.1:{own_port}/metrics", timeout=30).status_code == 200

    # per tool: calls started, and ended by final status
    assert by(found, "voice_tools_calls_started_total", "tool") == {"metered_ok": 1, "metered_flaky": 1}
    assert value(found, "voice_tools_calls_ended_total", tool="metered_ok", status="COMPLETED") == 1
    assert value(found, "voice_tools_calls_ended_total", tool="metered_flaky", status="FAILED") == 1
    assert sum(by(found, "voice_tools_calls_ended_total", "status").values()) == 2
    # the step histogram (one sample a link): metered_ok's one link, FETCH, which also completed the call
    # (COMPLETED has no work of its own: no link of its own); the flaky step ran twice (a retry)
    steps = by(found, "voice_tools_step_duration_seconds_count", "step", tool="metered_ok")
    assert steps == {"FETCH": 1}
    assert by(found, "voice_tools_step_duration_seconds_count", "step", tool="metered_flaky") == {"TRY": 2}
    assert value(found, "voice_tools_step_duration_seconds_bucket", tool="metered_ok", step="FETCH", le="+Inf") == 1
    assert value(found, "voice_tools_step_duration_seconds_sum", tool="metered_ok", step="FETCH") > 0
    # retries and outcomes of the tasks
    assert by(found, "voice_tools_tasks_total", "outcome", task="tools.metered_flaky.TRY") == \
        {"retried": 1, "succeeded": 1}
    assert by(found, "voice_tools_tasks_total", "outcome", task="tools.metered_ok.FETCH") == {"succeeded": 1}
    # callbacks: progress and completed of metered_ok, failed of metered_flaky, each delivered at once
    assert by(found, "voice_tools_callback_attempts_total", "event", outcome="delivered") == \
        {"progress": 1, "completed": 1, "failed": 1}
    assert by(found, "voice_tools_callback_attempts_total", "outcome") == {"delivered": 3}
    assert value(found, "voice_tools_callback_attempt_duration_seconds_count", outcome="delivered") == 3
    # the exporter read every queue of its registry from the broker; the tools' queues were drained
    assert by(found, "voice_tools_queue_depth", "queue")["tools.send_email"] == 0
    depths = by(samples(scrape_registry(folder)), "voice_tools_queue_depth", "queue")
    assert depths["tools.metered_ok"] == 0 and depths["tools.metered_flaky"] == 0, depths


def listening_on(port: int, pids: list[int]) -> list[int]:
    """Which of ``pids`` hold a socket listening on ``port``."""
    import psutil

    def listens(pid: int) -> bool:
        try:
            return any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
                       for conn in psutil.Process(pid).net_connections(kind="inet"))
        except psutil.Error:
            return False

    return [pid for pid in pids if listens(pid)]


def scrape_registry(folder) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics_page.registry(folder, app)).decode()


def scrape_exporter(folder) -> str:
    """Start ``voice-tools worker-metrics`` on ``folder``, scrape it once, stop it."""
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "voice_tools", "worker-metrics", "--host", "127.0.0.1", "--port", str(port),
         "--dir", str(folder)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = exporter.stdout.readline()
        assert json.loads(said)["message"] == f"worker metrics of {folder} on http://127.0.0.1:{port}/metrics", said
        answer = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert answer.status_code == 200
        return answer.text
    finally:
        exporter.terminate()
        assert exporter.wait(timeout=30) == 0


def test_the_api_metrics_show_none_of_the_workers_series(client, worker, relay):
    """The in-process worker runs a chain in this very process; the API's /metrics still shows only its own."""
    call = make_call("search_contacts", {"query": "John"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    assert wait_status(call.tool_call_id).status == "COMPLETED"
    text = client.get("/metrics", headers=AUTH).get_data(as_text=True)
    assert "voice_tools_http_requests_total" in text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert not [name for name in names if name.startswith(WORKER_SERIES) or name.startswith("flower_")], names


def test_calls_by_status_count_the_cancels_no_worker_made(client, worker, relay, tmp_path):
    """A cancel through the API or the operator CLI ends a call in no worker (so in no
    ``voice_tools_calls_ended_total``): the workers' page reads every call's status from the database."""
    from tests.test_cli import cli

    by_api, by_cli, _waiting = (make_call(callback_url=relay.url) for _ in range(3))
    done = make_call("search_contacts", {"query": "John"}, callback_url=relay.url)
    assert client.delete(f"/voice-tools/cancel/{by_api.tool_call_id}", headers=AUTH).status_code == 200
    assert "CANCELLED" in cli("calls", "cancel", by_cli.tool_call_id).output
    actions.confirm(done.tool_call_id)
    assert wait_status(done.tool_call_id).status == "COMPLETED"

    found = samples(scrape_registry(tmp_path))
    assert by(found, "voice_tools_calls", "status", tool="send_email") == {"CANCELLED": 2, "PENDING": 1}
    assert by(found, "voice_tools_calls", "status", tool="search_contacts") == {"COMPLETED": 1}


def test_enqueueing_inside_a_transaction_waits_for_its_commit():
    published: list[str] = []

    def seen(sender=None, headers=None, **_):
        published.append(headers["id"])

    before_task_publish.connect(seen, weak=False)
    try:
        with db.session():
            attempts.deliver.apply_async(("no-such-event",))
            assert published == [], "published before the transaction committed"
        assert len(published) == 1
        with pytest.raises(RuntimeError), db.session():
            attempts.deliver.apply_async(("no-such-event",))
            raise RuntimeError("rolled back")
        time.sleep(0.1)
        assert len(published) == 1, "a rolled-back transaction published its task"
        assert attempts.deliver.apply_async(("no-such-event",)).id  # outside one: at once
        assert len(published) == 2
    finally:
        before_task_publish.disconnect(seen)


def test_the_consoles_step_figures_and_link_runs_are_the_runs_metrics_exports(metered, relay, tmp_path):
    """A real prefork worker runs ``metered_ok`` three times and ``metered_once`` (busy at its first try,
    then done). The console's tools view gives each step's runs, as many as the exporter's
    ``voice_tools_step_duration_seconds`` counts, and their p50 / p99 by nearest rank: a run's own time
    as its link recorded it (the very time the exporter observed); the console's call page lists
    ``metered_once``'s two runs, the first retried, with its reason."""
    from tasks.calls import browse
    from tasks.calls.callers import Caller

    folder = tmp_path / "worker-metrics"
    folder.mkdir()
    queues = [tool.queue for tool in metered.TOOLS]
    oks = [make_call("metered_ok", {"what": f"thing {i}"}, callback_url=relay.url) for i in range(3)]
    once = make_call("metered_once", {"what": str(tmp_path / "busy-once")}, callback_url=relay.url)
    with queues_taken_from_others(app, queues):
        with WorkerProcess(app, queues, pool="prefork", concurrency=2, log_dir=tmp_path, name="metered",
                           include=["tests.metered_tools"], env={"PROMETHEUS_MULTIPROC_DIR": str(folder)}):
            for call in (*oks, once):
                actions.confirm(call.tool_call_id)
            for call in (*oks, once):
                relay.wait_for(call.tool_call_id, "completed", timeout=60)
            found = samples(scrape_exporter(folder))

    shown, status = browse.call(once.tool_call_id, Caller("ops", admin=True))
    assert status == 200
    runs = shown["attempts"]
    assert [(r["step"], r["outcome"], r["reason"]) for r in runs] == [
        ("TRY", "retried", "TransientError"), ("TRY", "done", None)]  # its class: a tool's text never
    assert runs[0]["started_at"] < runs[1]["started_at"] and all(r["took_ms"] > 0 for r in runs)

    figures, status = browse.tool_figures(Caller("ops", admin=True))
    steps = {(tool["tool"], step["step"]): step for tool in figures["tools"] for step in tool["steps"]}
    assert set(steps) == {("metered_ok", "FETCH"), ("metered_once", "TRY")}
    recorded = {"metered_ok": sorted(r["took_ms"] for c in oks for r in row(c.tool_call_id).link_attempts),
                "metered_once": sorted(r["took_ms"] for r in runs)}
    for (tool, step), shown_step in steps.items():
        assert shown_step["runs"] == value(found, "voice_tools_step_duration_seconds_count", tool=tool, step=step)
        exported_s = value(found, "voice_tools_step_duration_seconds_sum", tool=tool, step=step)
        assert abs(exported_s - sum(recorded[tool]) / 1000) < 1e-6  # the runs the exporter observed
    ok, once_ms = recorded["metered_ok"], recorded["metered_once"]
    assert (steps[("metered_ok", "FETCH")]["p50_ms"], steps[("metered_ok", "FETCH")]["p99_ms"]) == (
        round(ok[1], 1), round(ok[2], 1))  # of 3 runs: the 2nd and the 3rd, each a run's own time
    assert (steps[("metered_once", "TRY")]["p50_ms"], steps[("metered_once", "TRY")]["p99_ms"]) == (
        round(once_ms[0], 1), round(once_ms[1], 1))
    assert steps[("metered_ok", "FETCH")]["runs"] == 3 and steps[("metered_once", "TRY")]["runs"] == 2
    exported_s = value(found, "voice_tools_step_duration_seconds_sum", tool="metered_once", step="TRY")
    assert abs(exported_s - sum(r["took_ms"] for r in runs) / 1000) < 1e-6  # the very figures, not alike ones
