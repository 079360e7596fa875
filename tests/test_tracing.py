"""One trace per call (OpenTelemetry), seen from outside: real gunicorn (the Procfile's web line) and a
real ``celery -A tasks worker`` started with the OTLP variables, exporting to a collector made here
(``tests/otlp_receiver.py``: OTLP/HTTP protobuf decoded with ``opentelemetry-proto``'s classes).

- a send_email call recorded with a relay's ``traceparent``, confirmed and resumed later on connections
  of their own (without one): every span is in the relay's trace, each link once, the callbacks'
  ``traceparent`` names their spans, the events and the log lines carry the ids;
- a pool child killed in the middle of a link: both attempts of the link are in the trace;
- a worker stopped right after a link: the link's span reaches the collector all the same;
- with the variables unset: no tracing module imported, no exporter thread, in a served app and in a
  worker that ran a chain.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import requests

from models import release
from support.procs import ROOT, free_port, stop_process
from support.sse_client import Stream
from support.worker_process import WorkerProcess, queues_taken_from_others
from tasks import app
from tests.conftest import AUTH
from tests.helpers import wait_status
from tests.otlp_receiver import GrpcReceiver, Receiver, Span, tree
from tests.test_worker_loss import link_held_in_side_effect, outbox_row_held
from tests.web_server import gunicorn_web

sys.path.insert(0, str(ROOT / "clients" / "python" / "src"))
from voice_tools_relay import trace_context  # noqa: E402  (the relay's Python client, from its source folder)

pytestmark = pytest.mark.slow

QUEUE = "tools.send_email"
PREPARING, SENDING = "tools.send_email.PREPARING", "tools.send_email.SENDING"
PAUSE_S = 1.0  # between the checkpoint and the resume: the person's answer
OTEL_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@pytest.fixture
def receiver():
    with Receiver() as collector:
        yield collector


@pytest.fixture
def own_queues():
    """The subprocess workers are the only consumers of send_email's links and the callbacks' retries."""
    with queues_taken_from_others(app, [QUEUE, "callbacks"]):
        yield


def traced(receiver: Receiver) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}


def relay_traceparent() -> tuple[str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, f"00-{trace_id}-{span_id}-01"


def record(url: str, relay, traceparent: str | None, tag: str) -> str:
    headers = {**AUTH, "Connection": "close", **({"traceparent": traceparent} if traceparent else {})}
    created = requests.post(f"{url}/voice-tools/pending", headers=headers, timeout=30, json={
        "session_id": f"sess_{tag}", "function": "send_email", "callback_url": f"{relay.base}/hook",
        "parameters": {"to": f"{tag}@example.com", "subject": f"Traced {tag}"}})
    assert created.status_code == 201, created.text
    return created.json()["tool_call_id"]


def post_alone(url: str, path: str, **kwargs) -> requests.Response:
    """A request on a connection of its own (closed after it), with no ``traceparent``."""
    with requests.Session() as session:
        answer = session.post(f"{url}{path}", headers={**AUTH, "Connection": "close"}, timeout=30, **kwargs)
    assert answer.status_code in (200, 202), answer.text
    return answer


def named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def test_a_call_is_one_trace_from_the_relays_request_to_its_callbacks(tmp_path, relay, receiver, own_queues):
    env = traced(receiver)
    with gunicorn_web(**env) as url, \
            WorkerProcess(app, [QUEUE, "callbacks"], concurrency=1, log_dir=tmp_path, name="traced", env=env) as worker:
        trace_id, traceparent = relay_traceparent()
        stream = Stream(f"{url}/voice-tools/events/sess_one", {**AUTH, "traceparent": traceparent})
        call_id = record(url, relay, traceparent, "one")
        post_alone(url, f"/voice-tools/confirm/{call_id}")
        relay.wait_for(call_id, "checkpoint", timeout=60)
        asked = time.time_ns()
        time.sleep(PAUSE_S)  # the person thinks it over
        answered = time.time_ns()
        post_alone(url, f"/voice-tools/resume/{call_id}", json={"action": "proceed"})
        relay.wait_for(call_id, "completed", timeout=60)
        assert wait_status(call_id, timeout=30).status == "COMPLETED"
        streamed = [stream.next_event()[1] for _ in range(4)]
        stream.close()

        def complete(spans: list[Span]) -> bool:
            sent = {h["traceparent"].split("-")[2] for h in relay.headers if "traceparent" in h}
            return len(named(spans, SENDING)) >= 1 and sent <= {s.span_id for s in spans} \
                and sum(s.kind == 2 for s in spans) >= 4

        spans = receiver.wait(complete, timeout=60)
        worker_log = worker.log()
    print(f"\nthe trace of {call_id}:\n{tree(spans)}")

    # every span of the call, from every process, is in the relay's trace
    assert {s.trace_id for s in spans} == {trace_id}, tree(spans)
    assert {s.service for s in spans} == {"voice-tools-api", "voice-tools-worker"}
    assert all(s.resource.get("deployment.environment") == "test" for s in spans)
    assert {s.resource.get("service.version") for s in spans} == {release.VERSION}  # the release that made them
    by_id = {s.span_id: s for s in spans}
    # the server spans: pending's parent is the relay's span; confirm and resume, sent without a
    # traceparent on connections of their own, join the trace kept with the call
    servers = {s.name: s for s in spans if s.kind == 2}  # SPAN_KIND_SERVER
    assert set(servers) == {"POST /voice-tools/pending", "POST /voice-tools/confirm/<tool_call_id>",
                            "POST /voice-tools/resume/<tool_call_id>", "GET /voice-tools/events/<session_id>"}, \
        tree(spans)
    pending = servers["POST /voice-tools/pending"]
    assert pending.parent_id == traceparent.split("-")[2]
    assert servers["POST /voice-tools/confirm/<tool_call_id>"].parent_id == pending.span_id
    assert servers["POST /voice-tools/resume/<tool_call_id>"].parent_id == pending.span_id
    # each link once (its step done by the link before it has no link), child of the span that sent it,
    # which is a child of the request that started its chain
    links = [s for s in spans if s.name.startswith("tools.send_email.")]
    assert sorted(s.name for s in links) == [PREPARING, SENDING], tree(spans)
    for link, request in ((named(links, PREPARING)[0], "confirm"), (named(links, SENDING)[0], "resume")):
        assert link.attributes["voice_tools.tool_call_id"] == call_id
        assert link.attributes["voice_tools.tool"] == "send_email"
        assert link.attributes["voice_tools.step"] == link.name.rsplit(".", 1)[1]
        assert link.attributes["voice_tools.attempt"] == 1
        assert link.attributes["voice_tools.outcome"] == "success"
        sender = by_id[link.parent_id]
        assert sender.name == f"apply_async/{link.name}" and sender.kind == 4  # PRODUCER
        assert by_id[sender.parent_id] is servers[f"POST /voice-tools/{request}/<tool_call_id>"]
        assert sender.end_ns <= link.start_ns or sender.start_ns <= link.start_ns  # the queue's wait is visible
    # a publish is its apply_async span alone: the Redis commands that send the message make none, nor
    # does any other command of the broker's connection; the fair share's count, on our own client, does
    assert not [s for s in spans if s.name.split()[0] in ("LPUSH", "SADD", "PING")], tree(spans)
    assert [s for s in spans if s.name == "EVALSHA" and s.parent_id == pending.span_id], tree(spans)
    # the person's pause between the checkpoint and the resume is a gap: no span is open in the middle of it
    middle = (asked + answered) // 2
    assert named(spans, "callback checkpoint")[0].end_ns < middle < servers[
        "POST /voice-tools/resume/<tool_call_id>"].start_ns
    assert not [s for s in spans if s.start_ns < middle < s.end_ns], tree(spans)
    # the database statements are children in the trace, named by what they do and with their SQL, prepared
    # on the server or not (no "EXECUTE voice_tools_...")
    statements = [s for s in spans if s.parent_id == named(links, SENDING)[0].span_id
                  and s.attributes.get("db.system") == "postgresql"]
    assert "UPDATE tool_calls" in {s.name for s in statements}, tree(spans)
    assert all("tool_calls" in s.attributes["db.statement"] for s in named(statements, "UPDATE tool_calls"))
    assert not [s for s in spans if s.name in ("EXECUTE", "PREPARE", "WITH")], tree(spans)
    # each callback names its own span; the event's JSON names the span that made it
    events = relay.events_for(call_id)
    assert [e["event"] for e in events] == ["progress", "checkpoint", "progress", "completed"]
    for event, headers in zip(events, [h for h, e in zip(relay.headers, relay.events) if e["tool_call_id"] == call_id]):
        assert trace_context(headers) == {"traceparent": headers["traceparent"]}  # the Python client reads it
        version, sent_trace, sent_span, flags = headers["traceparent"].split("-")
        assert (version, sent_trace, flags) == ("00", trace_id, "01")
        posted = by_id[sent_span]
        assert posted.name == f"callback {event['event']}" and posted.kind == 3  # CLIENT
        assert posted.attributes["voice_tools.event_id"] == event["event_id"]
        assert event["trace_id"] == trace_id and event["span_id"] in by_id
        assert by_id[event["span_id"]].name.startswith("tools.send_email.")
    # the stream's events carry the same ids as the callbacks' (the same rows)
    assert [(e["event_id"], e["trace_id"], e["span_id"]) for e in streamed] == \
        [(e["event_id"], e["trace_id"], e["span_id"]) for e in events]
    # the worker's log lines of the call carry the trace and the span of their link
    lines = [json.loads(line) for line in worker_log.splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("tool_call_id") == call_id and line.get("task")]
    assert mine and all(line["trace_id"] == trace_id and line["span_id"] in by_id for line in mine), mine[:3]


def test_a_redelivered_link_shows_both_attempts(tmp_path, relay, receiver, own_queues):
    """A pool child killed in the middle of SENDING: the worker's main process ends the lost attempt's span,
    the run of the requeued message is the second attempt; both in the call's trace."""
    env = traced(receiver)
    with gunicorn_web(**env) as url, \
            WorkerProcess(app, [QUEUE, "callbacks"], concurrency=2, log_dir=tmp_path, name="lost", env=env) as worker:
        trace_id, traceparent = relay_traceparent()
        call_id = record(url, relay, traceparent, "lost")
        post_alone(url, f"/voice-tools/confirm/{call_id}")
        relay.wait_for(call_id, "checkpoint", timeout=60)
        # exported before a child is killed (a killed process's spans not yet exported are lost with it)
        receiver.wait(lambda found: named(found, PREPARING) and named(found, "callback checkpoint"), timeout=60)
        with outbox_row_held(call_id):
            post_alone(url, f"/voice-tools/resume/{call_id}", json={"action": "proceed"})
            first = link_held_in_side_effect(worker, call_id)
            worker.kill_child(first["worker_pid"])
            worker.wait_active(SENDING, [call_id], not_pid=first["worker_pid"], timeout=60)
            assert not psutil.pid_exists(first["worker_pid"]) or \
                psutil.Process(first["worker_pid"]).status() == psutil.STATUS_ZOMBIE
        assert wait_status(call_id, timeout=60).status == "COMPLETED"
        spans = receiver.wait(lambda found: len(named(found, SENDING)) >= 2 and any(
            s.name == "callback completed" for s in found), timeout=60)
    print(f"\nthe trace of {call_id}:\n{tree(spans)}")
    assert len(named(spans, PREPARING)) == 1, tree(spans)
    sending = sorted(named(spans, SENDING), key=lambda s: s.start_ns)
    assert len(sending) == 2, tree(spans)
    lost, again = sending
    assert {lost.trace_id, again.trace_id} == {trace_id}
    assert (lost.attributes["voice_tools.attempt"], lost.attributes["voice_tools.outcome"]) == (1, "worker_lost")
    assert lost.status_code == 2  # STATUS_CODE_ERROR
    assert (again.attributes["voice_tools.attempt"], again.attributes["voice_tools.outcome"]) == (2, "success")
    assert again.attributes["voice_tools.redelivered"] is True
    assert lost.parent_id == again.parent_id  # the same message, sent once
    assert lost.end_ns <= again.start_ns


RUNS_PROBE = textwrap.dedent("""
    import json
    from celery import Celery, signals
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    import voice_tools_tracing as tracing
    from tasks.worker import run_spans as runs

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    trace.set_tracer_provider(provider)
    tracing._started = True
    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"

    @signals.task_prerun.connect(weak=False)
    def carried(task=None, **_):  # as a worker's request has the message's headers: its attributes
        task.request.traceparent = parent

    runs.instrument()
    probe = Celery("probe", broker="memory://")

    class Expected(Exception):
        pass

    @probe.task(name="probe.ok")
    def ok(x):
        return x

    @probe.task(name="probe.fails")
    def fails(x):
        raise ValueError("no luck")

    @probe.task(name="probe.refuses", throws=(Expected,))
    def refuses(x):
        raise Expected("as planned")

    for task in (ok, fails, refuses):
        task.apply(("tc_probe",), task_id=task.name + "-id")
    sent = probe.send_task("probe.ok", ("tc_probe",))
    message = probe.connection_for_write().default_channel.basic_get("celery")
    seen = [{"name": s.name, "kind": s.kind.name, "parent": s.parent and format(s.parent.span_id, "016x"),
             "trace": format(s.context.trace_id, "032x"), "span": format(s.context.span_id, "016x"),
             "status": s.status.status_code.name, "events": [e.name for e in s.events],
             "attributes": dict(s.attributes)} for s in exported.get_finished_spans()]
    print(json.dumps({"spans": seen, "traceparent": message.headers.get("traceparent")}))
""")


def test_runs_and_publishes_are_spans_with_our_attributes_alone():
    """A run is a consumer span named after its task, child of the message's ``traceparent``, with the
    voice_tools attributes only (no copy of Celery's request fields); a failure is an ERROR with the
    exception, unless the task ``throws`` it; a publish is a producer span whose context the message carries."""
    env = {k: v for k, v in os.environ.items() if k not in OTEL_VARIABLES}
    ran = subprocess.run([sys.executable, "-c", RUNS_PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    by_name = {s["name"]: s for s in seen["spans"]}
    assert set(by_name) == {"probe.ok", "probe.fails", "probe.refuses", "apply_async/probe.ok"}, seen
    for name, outcome, status in (("probe.ok", "success", "UNSET"), ("probe.fails", "failure", "ERROR"),
                                  ("probe.refuses", "failure", "UNSET")):
        run = by_name[name]
        assert (run["kind"], run["trace"], run["parent"]) == ("CONSUMER", "a" * 32, "b" * 16), run
        assert run["attributes"] == {"voice_tools.task": name, "voice_tools.attempt": 1,
                                     "voice_tools.outcome": outcome}, run
        assert run["status"] == status and run["events"] == (["exception"] if status == "ERROR" else []), run
    published = by_name["apply_async/probe.ok"]
    assert published["kind"] == "PRODUCER" and published["parent"] is None
    assert seen["traceparent"].split("-")[:3] == ["00", published["trace"], published["span"]]


INSTRUMENTATIONS_PROBE = textwrap.dedent("""
    from opentelemetry import trace
    from sqlalchemy import text
    from app import shares
    from models import db
    from tasks.celery_app import app
    import voice_tools_tracing as tracing
    from voice_tools_tracing import sdk

    assert sdk.start("probe", "0+probe")
    with app.connection_for_write() as broker:
        assert broker.transport.driver_type == "redis", broker.transport.driver_type
        with tracing.tracer().start_as_current_span("probe"):
            with db.session() as s:
                s.execute(text("SELECT 41 + 1"))
            shares.counts().client.ping()  # our own Redis client: a span
            broker.default_channel.client.echo("the broker's")  # the broker's own traffic: none
    trace.get_tracer_provider().force_flush()
""")


@pytest.mark.parametrize("disabled, statements, commands", [
    ("", True, True),
    ("psycopg2", False, True),
    (" redis , psycopg2", False, False),
])
def test_the_standard_variable_turns_off_an_instrumentation(receiver, disabled, statements, commands):
    """``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` (the names of opentelemetry-python's entry points, comma
    separated) leaves out the statements' or our Redis clients' commands' spans; our own spans stay. The
    broker's connection is never instrumented: its commands make no span, even inside a trace."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(traced(receiver), OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=disabled)
    ran = subprocess.run([sys.executable, "-c", INSTRUMENTATIONS_PROBE], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    receiver.wait(lambda got: any(s.name == "probe" for s in got))
    time.sleep(0.5)  # nothing more comes: force_flush sent every span before the probe ended
    names = {s.name for s in receiver.spans}
    assert ("SELECT" in names, "PING" in names) == (statements, commands), tree(receiver.spans)
    assert names <= {"probe", "PING", "SELECT", "select", "show", "SET"}, tree(receiver.spans)  # a new connection's
    assert len({s.trace_id for s in receiver.spans}) == 1


PROBE = textwrap.dedent("""
    import json, sys, threading
    from app import create_app
    AUTH = json.loads(sys.argv[1])
    client = create_app().test_client()
    created = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_off", "function": "send_email", "parameters": {"to": "off@example.com", "subject": "Off"}})
    assert created.status_code == 201, created.get_json()
    call_id = created.get_json()["tool_call_id"]
    assert client.post(f"/voice-tools/confirm/{call_id}?wait=30", headers=AUTH).status_code == 200
    print(json.dumps({"call": call_id, "modules": sorted(sys.modules), "threads": [t.name for t in threading.enumerate()]}))
""")

TRACING_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.instrumentation", "voice_tools_tracing.sdk",
                   "tasks.worker.run_spans")


def loaded_for_tracing(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(TRACING_MODULES)]


def test_off_without_the_variables_nothing_of_it_is_loaded(tmp_path, own_queues):
    """No OTLP endpoint: a served app that recorded and confirmed a call, and a worker whose pool ran its link,
    loaded no tracing SDK, exporter or instrumentation, and run no exporter thread; the call keeps no trace."""
    env = {k: v for k, v in os.environ.items() if k not in OTEL_VARIABLES}
    with WorkerProcess(app, [QUEUE], pool="solo", log_dir=tmp_path, name="untraced", env=env,
                       include=["tests.tracing_probe"]) as worker:
        served = subprocess.run([sys.executable, "-c", PROBE, json.dumps(AUTH)], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert served.returncode == 0, served.stderr[-3000:]
        seen = json.loads(served.stdout.strip().splitlines()[-1])
        assert wait_status(seen["call"], "PREPARED", timeout=30).trace_context is None
        assert loaded_for_tracing(seen["modules"]) == []
        assert not [t for t in seen["threads"] if "Otel" in t or "otel" in t.lower()], seen["threads"]
        answer = tmp_path / "loaded.json"
        app.send_task("tests.tracing_probe.loaded", (str(answer),), queue=QUEUE)
        deadline = time.monotonic() + 60
        while not answer.exists():
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.1)
        ran = json.loads(answer.read_text())
    assert loaded_for_tracing(ran["modules"]) == []
    assert not [t for t in ran["threads"] if "otel" in t.lower()], ran["threads"]


def test_a_call_recorded_here_is_joined_without_reading_its_row(monkeypatch):
    """A request about a call this process recorded lately takes the call's trace context from memory (no
    statement on its path); a call recorded elsewhere is read; memory forgets after a while and beyond its size."""
    from collections import OrderedDict

    import voice_tools_tracing as tracing
    from models import trace_context as calls

    monkeypatch.setattr(tracing, "_started", True)
    monkeypatch.setattr(tracing, "_kept_here", OrderedDict())
    read: list[str] = []
    elsewhere = f"00-{'c' * 32}-{'d' * 16}-01"

    class Kept:
        def one_or_none(self, _conn, params):
            read.append(params["p_id"])
            return (elsewhere,)

    monkeypatch.setattr(calls, "_KEPT", Kept())
    here = f"00-{'a' * 32}-{'b' * 16}-01"
    tracing.remember("tc_here", here)
    assert calls.kept_context("tc_here") == here and read == []
    assert calls.kept_context("tc_elsewhere") == elsewhere and read == ["tc_elsewhere"]
    now = time.monotonic()
    monkeypatch.setattr(tracing.time, "monotonic", lambda: now + tracing.KEPT_HERE_S + 1)
    assert calls.kept_context("tc_here") == elsewhere and read[-1] == "tc_here"  # forgotten: read again
    monkeypatch.setattr(tracing, "KEPT_HERE_MAX", 2)
    for n in range(3):
        tracing.remember(f"tc_{n}", here)
    assert [tracing.remembered(f"tc_{n}") for n in range(3)] == [None, here, here]
    monkeypatch.setattr(tracing, "_started", False)  # tracing off: nothing kept
    tracing.remember("tc_off", here)
    assert tracing.remembered("tc_off") is None


NO_SDK_PROBE = textwrap.dedent("""
    import json, sys
    {first}
    from app import create_app
    from tasks import app
    create_app()
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.ping()
    print(json.dumps(sorted(name for name, module in sys.modules.items()
                            if name.startswith("opentelemetry") and module is not None)))  # None: marked absent
""")


@pytest.mark.parametrize("first", [
    "pass",  # the app factory, then the Celery app
    "import app.gunicorn_conf; from app import shares",  # a gunicorn worker: its config, its post_fork, then the app
])
def test_off_the_sdk_is_not_imported_by_redis_either(first):
    """No OTLP endpoint: a process that makes the API app and the Celery app and talks to Redis has not
    imported OpenTelemetry's SDK (redis-py imports its metrics module whenever the SDK is installed)."""
    env = {k: v for k, v in os.environ.items() if k not in OTEL_VARIABLES}
    ran = subprocess.run([sys.executable, "-c", NO_SDK_PROBE.format(first=first)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    loaded = json.loads(ran.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m.startswith("opentelemetry.sdk")] == [], loaded


@contextmanager
def mcp_face(env: dict[str, str]) -> Iterator[str]:
    """``voice-tools mcp`` in a process of its own with ``env``; its /mcp URL once /healthz answers."""
    port = free_port()
    with open(Path(env["VOICE_TOOLS_TEST_LOG_DIR"]) / "mcp.log", "wb") as log:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("voice-tools")), "mcp", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the MCP face exited"
            try:
                if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "the MCP face did not answer"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop_process(proc)


async def mcp_call(url: str, name: str, arguments: dict, traceparent: str | None = None) -> dict:
    """One tool call on an MCP session of its own (its own HTTP connections), with ``traceparent`` on its requests."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {**AUTH, **({"traceparent": traceparent} if traceparent else {})}
    async with httpx2.AsyncClient(headers=headers) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            result = await client.call_tool(name, arguments)
    assert not result.is_error, result.structured_content
    return result.structured_content


def test_an_mcp_call_is_one_trace_too(tmp_path, relay, receiver, own_queues):
    """The MCP face: a tool call's HTTP request with a relay's traceparent is its span's parent; a later tool call
    about the call, sent without one, runs in the call's trace (linked to its request's own trace)."""
    import anyio

    env = {**os.environ, **traced(receiver), "VOICE_TOOLS_TEST_LOG_DIR": str(tmp_path)}
    with mcp_face(env) as url, \
            WorkerProcess(app, [QUEUE, "callbacks"], concurrency=1, log_dir=tmp_path, name="mcp", env=env):
        trace_id, traceparent = relay_traceparent()
        recorded = anyio.run(mcp_call, url, "request_tool", {
            "session_id": "sess_mcp", "function": "send_email", "callback_url": f"{relay.base}/hook",
            "parameters": {"to": "mcp@example.com", "subject": "Traced over MCP"}}, traceparent)
        call_id = recorded["tool_call_id"]
        anyio.run(mcp_call, url, "confirm_tool", {"tool_call_id": call_id})
        relay.wait_for(call_id, "checkpoint", timeout=60)
        spans = receiver.wait(lambda found: named(found, PREPARING) and named(found, "callback checkpoint"),
                              timeout=60)
    print(f"\nthe MCP spans:\n{tree(spans)}")
    assert {s.service for s in spans} >= {"voice-tools-mcp", "voice-tools-worker"}
    by_id = {s.span_id: s for s in spans}
    relays = [s for s in spans if s.kind == 2 and s.parent_id == traceparent.split("-")[2]]
    assert relays and all(s.trace_id == trace_id and s.name == "POST /mcp" for s in relays)  # the relay's requests
    [joined] = named(spans, "mcp confirm_tool")
    assert joined.trace_id == trace_id and joined.attributes["voice_tools.tool_call_id"] == call_id
    [(linked_trace, linked_span)] = joined.links  # the confirm's own request (the MCP SDK's span in it), its own trace
    assert linked_trace != trace_id and by_id[linked_span].name == "tools/call confirm_tool"
    assert by_id[by_id[linked_span].parent_id].name == "POST /mcp"
    [link] = named(spans, PREPARING)
    assert link.trace_id == trace_id and by_id[by_id[link.parent_id].parent_id] is joined
    assert all(s.trace_id == trace_id for s in spans if s.name.startswith(("tools.", "callback ")))


def test_grpc_when_the_protocol_says_so(relay):
    """``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``: the same spans, over OTLP/gRPC, with the service name and
    sampler the variables give."""
    with GrpcReceiver() as receiver:
        env = {**traced(receiver), "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "relay-facing-api",
               "OTEL_TRACES_SAMPLER": "parentbased_always_off"}
        with gunicorn_web(**env) as url:
            trace_id, traceparent = relay_traceparent()
            # first a turn the relay did not sample, and one with no traceparent (a root: off by this sampler, on by
            # the default one): had they made spans, they would be queued before the next one's
            unsampled = record(url, relay, relay_traceparent()[1][:-2] + "00", "unsampled")
            record(url, relay, None, "root")
            call_id = record(url, relay, traceparent, "grpc")
            spans = receiver.wait(lambda found: named(found, "POST /voice-tools/pending"), timeout=60)
    assert receiver.paths and set(receiver.paths) == {"grpc"}
    [pending] = named(spans, "POST /voice-tools/pending")
    assert pending.trace_id == trace_id and pending.service == "relay-facing-api"
    assert {s.trace_id for s in spans} == {trace_id}  # nothing of the unsampled request, nor of the root
    assert call_id != unsampled


def test_beat_traces_the_sweeps_it_sends(tmp_path, receiver):
    """``celery -A tasks beat`` with the variables set: each sweep it sends is a span of its own (voice-tools-beat)."""
    env = {**os.environ, **traced(receiver)}
    with open(tmp_path / "beat.log", "wb") as log:
        beat = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tasks", "beat", "--loglevel", "INFO",
                                 "-s", str(tmp_path / "schedule")], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        spans = receiver.wait(lambda found: any(s.name.startswith("apply_async/maintenance.") for s in found),
                              timeout=90)
    finally:
        stop_process(beat)
    sent = [s for s in spans if s.name.startswith("apply_async/maintenance.")]
    assert {s.service for s in sent} == {"voice-tools-beat"} and all(s.kind == 4 for s in sent)  # PRODUCER


def test_a_link_run_just_before_a_warm_stop_reaches_the_collector(tmp_path, receiver, own_queues):
    """The batch processor would export a minute later (``OTEL_BSP_SCHEDULE_DELAY``): the worker is stopped
    (SIGTERM to its main process, as `voice-tools run` stops it at a Ctrl-C) right after its pool child ran
    a link; the pool child exports its spans as it exits, the main process as it stops."""
    from tasks.calls import actions
    from tests.helpers import make_call

    env = {**traced(receiver), "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    worker = WorkerProcess(app, [QUEUE, "callbacks"], concurrency=1, log_dir=tmp_path, name="stopped", env=env)
    with worker:
        call = make_call("send_email", {"to": "stop@example.com", "subject": "Stopped"}, session_id="sess_stop")
        actions.confirm(call.tool_call_id)
        assert wait_status(call.tool_call_id, "PREPARED", timeout=60).status == "PREPARED"
        deadline = time.monotonic() + 30  # the link's end reached the main process (not lost at the stop)
        while not any(PREPARING in line and "succeeded" in line for line in worker.log().splitlines()):
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.1)
        assert [s.name for s in receiver.spans] == []  # nothing exported on the schedule yet
        os.kill(worker.pid, signal.SIGTERM)  # as `voice-tools run` stops its worker (its main process)
        assert worker.proc.wait(60) == 0, worker.log()[-3000:]
    spans = receiver.wait(lambda found: named(found, PREPARING), timeout=10)
    assert [s.attributes["voice_tools.tool_call_id"] for s in named(spans, PREPARING)] == [call.tool_call_id]
    assert {s.service for s in named(spans, PREPARING)} == {"voice-tools-worker"}


HIDDEN_PROBE = textwrap.dedent("""
    import sys

    EXTRA = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation")

    class NotInstalled:  # the wheel's plain install: no `tracing` extra (the API comes with the MCP SDK)
        def find_spec(self, name, path=None, target=None):
            if any(name == package or name.startswith(package + ".") for package in EXTRA):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    from app import create_app

    answer = create_app().test_client().get("/healthz")
    from voice_tools_tracing import sdk
    from tasks.worker import tracing as links  # a worker's and beat's start, and a stop: untraced, nothing more said
    from app import mcp_server
    from voice_tools import launcher
    import os

    links._worker_started(None)
    links._beat_started()
    sdk.stop()
    assert mcp_server.tracing.started("mcp") is False

    print(launcher.tracing_line(dict(os.environ)))  # what `voice-tools run` says in its banner
    print("answered", answer.status_code)
""")


def test_tracing_asked_for_without_its_packages_says_so_in_one_line_and_runs_untraced(receiver):
    """OTEL_EXPORTER_OTLP_ENDPOINT set, the tracing extra's packages not importable: the web process starts and
    answers, untraced, after one warning naming the variable, the packages missing and the command to install
    them (the line `voice-tools run`'s banner says too), and a worker's, beat's and the MCP face's start say
    nothing more; no traceback."""
    env = {**os.environ, **traced(receiver)}
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    ran = subprocess.run([sys.executable, "-c", HIDDEN_PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.splitlines()[-1] == "answered 200"
    assert "Traceback" not in ran.stderr and "ModuleNotFoundError" not in ran.stderr, ran.stderr[-3000:]
    said = [json.loads(line)["message"] if line.startswith("{") else line
            for line in ran.stderr.splitlines() if "tracing is asked for" in line]
    assert said == ran.stdout.splitlines()[-2:-1] == [
        "tracing is asked for (OTEL_EXPORTER_OTLP_ENDPOINT set) but its packages are not installed "
        "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http, opentelemetry-instrumentation-psycopg2, "
        "opentelemetry-instrumentation-redis): running untraced; install "
        f"them with `{sys.executable} -m pip install 'voice-tools[tracing]'`, or unset the variable"], ran.stderr
    assert receiver.requests == 0


def test_the_packages_said_missing_are_those_this_process_would_import(monkeypatch):
    """The exporter of the protocol chosen only, and no instrumentation left out: a process with those
    installed traces (here every package is installed: none is missing, whatever the choice)."""
    import voice_tools_tracing as tracing

    monkeypatch.setattr(tracing, "PACKAGES", tracing.PACKAGES + (("not-installed-exporter", "no_such.grpc", "grpc"),
                                                                 ("not-installed-psycopg2", "no_such.pg", "psycopg2")))
    asked = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert tracing.missing_packages(asked) == ["not-installed-psycopg2"]
    assert tracing.missing_packages({**asked, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == \
        ["not-installed-exporter", "not-installed-psycopg2"]
    assert tracing.missing_packages({**asked, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "psycopg2"}) == []
    assert tracing.missing_packages({**asked, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "*"}) == []
    assert tracing.missing_line({}) is None and tracing.missing_line(asked) is not None


def raw_request(port: int, head: bytes) -> bytes:
    """One request's head sent on a connection of its own; the start of its answer."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head)
        answer = b""
        while b"\r\n" not in answer:
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer[:12]


def test_no_text_a_client_sent_reaches_the_log_through_tracing(tmp_path, receiver):
    """The trace headers a client sends, unauthenticated, oversized or invalid, on REST and MCP: none of their
    text reaches a log line (text format), OpenTelemetry's propagators' lines are bounded and say only that a
    header was refused, and a C1 control byte sent never reaches the log file raw."""
    env = {**traced(receiver), "VOICE_TOOLS_LOG_FORMAT": "text"}
    log = tmp_path / "web.log"
    with gunicorn_web(log_to=log, **env) as url, \
            mcp_face({**os.environ, **env, "VOICE_TOOLS_TEST_LOG_DIR": str(tmp_path)}) as mcp:
        port, mcp_port = int(url.rsplit(":", 1)[1]), int(mcp.split(":")[2].split("/")[0])
        start = b"GET /voice-tools/tools HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        before = log.stat().st_size
        flood = start + b"baggage: k=" + b"A" * 8170 + b"\r\n" + b"baggage: k=" + b"B" * 8170 + b"\r\n" * 2
        invalid = (start + b"baggage: " + b",".join(b"%d=bad value" % i for i in range(170)) + b"\r\ntracestate: "
                   + b"Z" * 8000 + b"==\r\n\r\n")
        c1 = (start + b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
              b"tracestate: \x9b31mRED\x9b0m==,ok=\x9bSTATE\r\n\r\n")
        answers = {raw_request(port, head) for head in (flood, invalid, c1) for _ in range(5)}
        assert answers == {b"HTTP/1.1 401"}, answers  # no token: refused, and nothing of them written
        mcp_answer = raw_request(mcp_port, b"POST /mcp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
                                           b"baggage: k=" + b"M" * 9000 + b",bad entry\r\ntracestate: "
                                           + b"Y" * 600 + b"\r\n\r\n{}")
        assert mcp_answer.startswith(b"HTTP/1.1 "), mcp_answer
        time.sleep(1.0)
        written = log.read_bytes()[before:]
        mcp_written = (tmp_path / "mcp.log").read_bytes()
    for text in (written, mcp_written):
        for sent in (b"AAAAAAAAAA", b"BBBBBBBBBB", b"bad value", b"ZZZZZZZZZZ", b"RED", b"STATE", b"MMMMMMMMMM",
                     b"bad entry", b"YYYYYYYYYY"):
            assert sent not in text, (sent, text[-3000:])
        assert bytes([0xC2, 0x9B]) not in text and b"\x9b" not in text
        assert text.count(b"Invalid baggage") == text.count(b"tracestate header") == 0, text[-3000:]
        assert text.count(b"a trace header was refused") <= 2, text[-3000:]  # bounded: at most one a minute per logger
    assert len(written) < 20_000, written[-3000:]  # 15 requests' access lines, no more


def test_a_callback_sends_only_the_trace_context_bounded(tmp_path, relay, receiver):
    """A relay's ``baggage`` goes to no callback; its ``tracestate`` is bounded as the W3C says (32 members,
    512 bytes: what does not fit is dropped from the end), on every callback of the call."""
    env = traced(receiver)
    members = [f"vendor{i:02d}=value{i:02d}{'x' * 20}" for i in range(40)]  # 40 members, 1,300 bytes
    read_queue = "tools.search_contacts"
    with queues_taken_from_others(app, [read_queue, "callbacks"]), gunicorn_web(**env) as url, \
            WorkerProcess(app, [read_queue, "callbacks"], concurrency=1, log_dir=tmp_path, name="bounded", env=env):
        trace_id, traceparent = relay_traceparent()
        headers = {**AUTH, "Connection": "close", "traceparent": traceparent, "tracestate": ",".join(members),
                   "baggage": "user.secret=hunter2,tenant=" + "t" * 2000}
        created = requests.post(f"{url}/voice-tools/execute", headers=headers, timeout=30, json={
            "session_id": "sess_bounded", "function": "search_contacts", "callback_url": f"{relay.base}/hook",
            "parameters": {"query": "john"}})
        assert created.status_code in (200, 201, 202), created.text
        call_id = created.json()["tool_call_id"]
        relay.wait_for(call_id, "completed", timeout=60)
    sent = [{k.lower(): v for k, v in h.items()} for h, e in zip(relay.headers, relay.events)
            if e["tool_call_id"] == call_id]
    assert sent and all(h["traceparent"].split("-")[1] == trace_id for h in sent), sent
    assert not [h for h in sent if "baggage" in h], sent
    for h in sent:
        state = h["tracestate"]
        assert len(state.encode()) <= 512 and len(state.split(",")) <= 32, state
        fit = max(n for n in range(33) if len(",".join(members[:n])) <= 512)  # 13 of them
        assert state.split(",") == members[:fit], state  # the first members, whole


def test_the_propagator_reads_and_sends_only_a_bounded_trace_context():
    """``voice_tools_tracing.headers``: the W3C limits applied as a tracestate is read, baggage never read."""
    from opentelemetry import baggage, trace

    from voice_tools_tracing.headers import TraceContextOnly, bounded

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    propagator = TraceContextOnly()
    read = propagator.extract({"traceparent": parent, "baggage": "k=v", "tracestate": "a=1,BAD,b=2,a=3," + "c=" + "x" * 200
                               + ",d=\x9b," + ",".join(f"m{i}=vvvvvvvv" for i in range(40))})  # over 512 bytes
    assert baggage.get_all(read) == {}
    state = trace.get_current_span(read).get_span_context().trace_state
    assert list(state.keys())[:3] == ["a", "b", "m0"] and len(state) == 32  # the invalid, the duplicate, the long: gone
    carrier: dict[str, str] = {}
    propagator.inject(carrier, context=read)
    assert set(carrier) == {"traceparent", "tracestate"} and carrier["traceparent"] == parent
    assert len(bounded([f"k{i}=" + "v" * 250 for i in range(3)])) == 0 and len(bounded([f"k{i}=" + "v" * 100 for i in range(9)])) == 4
    nothing = propagator.extract({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01", "tracestate": "a=1"})
    assert not trace.get_current_span(nothing).get_span_context().is_valid
